"""Quantized weights attached to the linear modules of a loaded model: exported GGUF blocks
(``gguf_export``, ``load_with_gguf_blocks``), an AWQ, GPTQ or compressed-tensors
checkpoint's packed values (``packed.py``), or int8 values computed at load
(``attach_int8``).

Each ``cadence.layers.linear.Linear`` whose checkpoint weights were all kept in blocks gets a
``quantized`` attribute, a ``QuantizedWeight`` of its own shape (a fused projection's parts
stacked as its rows are); a backend that runs quantized weights swaps those modules for its
kernel (backends/cpu/quantized.py). The module's fp32 weight stays until then: it is what
the blocks are checked against, bit for bit, before they are attached. Where the export or
the checkpoint already holds them exactly (GGUF blocks, a packed checkpoint's linears) and
the family takes tensors as they are, the fp32 weights are never written instead, so a
backend that does not run them must call ``materialize`` rather than ignore the attribute
(or refuse, as the CPU backend refuses ``gguf`` without its kernels).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cadence.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from cadence.quantization import INT8_GROUP, check_int8_split
from cadence.quantization.gguf_export import INDEX_FILE, TENSORS_FILE, blocks_dir

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class QuantizedWeight:
    """w = scale * q (+ offset) per group of ``group`` consecutive inputs: q [N, K] int8,
    scale [N, K / group] fp32, offset as scale or None."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight, each product and sum rounded as gguf's dequantization rounds it."""
        w = self.scale.repeat_interleave(self.group, dim=1) * self.q.float()
        if self.offset is not None:
            w = w + self.offset.repeat_interleave(self.group, dim=1)
        return w

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset)
                   if t is not None)


def regroup(weight: QuantizedWeight, group: int) -> QuantizedWeight:
    """The same weight with ``group`` inputs per scale (a divisor of its group): each scale
    (and offset) repeated."""
    times = weight.group // group
    if times == 1:
        return weight
    return QuantizedWeight(weight.q, weight.scale.repeat_interleave(times, dim=1),
                           None if weight.offset is None else
                           weight.offset.repeat_interleave(times, dim=1))


def _stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """A fused module's parts as one weight: rows stacked, every part at the finest group
    among them (Q6_K's 16 beside Q4_K's 32), so that one group size serves the module."""
    if len(parts) == 1:
        return parts[0]
    group = min(p.group for p in parts)
    parts = [regroup(p, group) for p in parts]
    offsets = None
    if any(p.offset is not None for p in parts):
        # w = s * q + 0 is w = s * q (a zero product's sign aside, which no sum can see).
        offsets = torch.cat([p.offset if p.offset is not None else torch.zeros_like(p.scale)
                             for p in parts])
    return QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                           offsets)


def _target(model: nn.Module, hf_name: str, embed: str, tied: bool, pattern: Any
            ) -> tuple[str, int | None] | None:
    """(our module name, shard index or None) for checkpoint weight ``hf_name``; None when
    no linear of this model (stage) takes it. ``pattern``: the model's fused-name pattern."""
    name = model.stage_weight_name(model.body_weight_name(hf_name))
    if name is None or (tied and name == "lm_head.weight"):
        return None  # another stage's; or a stored head the embeddings stand in for
    if name == embed:
        if not tied:
            return None  # the embedding lookup itself stays fp32
        name = "lm_head.weight"
    match = pattern.match(name) if pattern is not None else None
    if match is None:
        return name.rpartition(".")[0], None
    prefix, proj, _ = match.groups()
    fused, shard = model.fused_parts[proj]
    return f"{prefix}.{fused}", shard


def rank_share(module: nn.Module, part: int | None, weight: QuantizedWeight
               ) -> QuantizedWeight | None:
    """This tensor-parallel rank's share of ``weight`` (of fused part ``part``), cut as
    ``module.tp_load`` cuts the fp32 checkpoint tensor: rows for a column-parallel module
    (a head's zero padding included), inputs for a row-parallel one. None where a cut
    would split a group of inputs sharing a scale: that module stays fp32."""
    if getattr(module, "tp_size", 1) == 1:
        return weight
    if isinstance(module, ColumnParallelLinear):
        # Which checkpoint rows the cut takes, 1-based: 0 marks a padding row.
        rows = module.tp_load("weight", part, torch.arange(
            1, weight.shape[0] + 1, dtype=torch.float64).unsqueeze(1)).squeeze(1).long()

        def pick(t: torch.Tensor, fill: float) -> torch.Tensor:
            return torch.cat([t.new_full((1, t.shape[1]), fill), t])[rows]

        return QuantizedWeight(pick(weight.q, 0), pick(weight.scale, 1.0),
                               None if weight.offset is None else pick(weight.offset, 0.0))
    if isinstance(module, RowParallelLinear):
        cols, group = module.in_features, weight.group
        first = module.tp_rank * cols
        if first % group or cols % group:
            return None

        def cut(t: torch.Tensor, per: int) -> torch.Tensor:
            return t[:, first // per:(first + cols) // per].contiguous()

        return QuantizedWeight(cut(weight.q, 1), cut(weight.scale, group),
                               None if weight.offset is None else cut(weight.offset, group))
    return None


def load_with_gguf_blocks(model: nn.Module, folder: str,
                          skip: Callable[[str], bool] | None = None) -> int:
    """Load the converted ``folder``'s weights into ``model`` and attach its exported GGUF
    blocks (module docstring); returns how many modules got blocks. ``skip``: the names
    another pipeline stage or expert-parallel rank reads.

    Where the family takes checkpoint tensors as they are, a linear weight the blocks hold
    is never read: the export checked the blocks against it bit for bit, so the model is
    handed its shape only (``CausalLM.load_weights``' ``shape_only``) and the fp32 weight
    never takes memory. One that does not run from its blocks (a fused projection with a
    part in another format, a tensor-parallel share that would split a group) is then read
    after all. Other families read every weight, and each module's blocks are checked
    against it at load."""
    from safetensors import safe_open

    from cadence.model_loader import iterate_weights

    where = blocks_dir(folder)
    index = json.loads((where / INDEX_FILE).read_text())
    weights: dict[str, QuantizedWeight] = {}
    if index["formats"]:
        with safe_open(str(Path(where) / TENSORS_FILE), framework="pt") as f:
            keys = set(f.keys())
            for hf_name in index["formats"]:
                offset = f.get_tensor(f"{hf_name}.o") if f"{hf_name}.o" in keys else None
                weights[hf_name] = QuantizedWeight(f.get_tensor(f"{hf_name}.q"),
                                                   f.get_tensor(f"{hf_name}.s"), offset)
    lean = model.takes_tensors_as_they_are
    embed = f"{model._body}.{model._embed}.weight"
    # The embedding table is looked up, not multiplied: always read (a tied head shares it).
    shape_only = {n for n in weights if model.body_weight_name(n) != embed} if lean else set()
    model.load_weights(iterate_weights(folder, skip, shape_only), shape_only=shape_only)
    attached = attach_blocks(model, weights, "GGUF", verify=not lean)
    # Another stage's names were never streamed: none of this stage's to write.
    left = {n for n in shape_only - attached if skip is None or not skip(n)}
    write_unattached(model, left, iterate_weights(folder, lambda name: name not in left),
                     "GGUF")
    return sum(1 for m in model.modules() if getattr(m, "quantized", None) is not None)


def write_unattached(model: nn.Module, names: set[str],
                     tensors: Iterator[tuple[str, torch.Tensor]], what: str) -> None:
    """Write the fp32 weights ``names`` from ``tensors``: weights loaded as their shape only
    whose quantized values could not be attached, which run in fp32 instead. One that is
    still not written is an error, never run."""
    if not names:
        return
    left = names - model.load_weights(tensors, partial=True)
    if left:
        raise RuntimeError(f"{what} weights neither run quantized nor written in fp32: "
                           f"{sorted(left)[:5]}")


def attach_blocks(model: nn.Module, weights: dict[str, QuantizedWeight], what: str,
                  verify: bool = True) -> set[str]:
    """Attach quantized ``weights`` (by checkpoint weight name) to ``model``'s linears
    (module docstring): a fused module's parts stacked, this rank's share cut, the result
    checked against the module's fp32 weight (``verify``; off where that weight was never
    written because it is the blocks' own dequantization). Returns the names of the
    weights attached; ``what`` names the source in warnings."""
    embed = f"{model._body}.{model._embed}.weight"
    # Tied: the head's weight is the embeddings' (a pipeline stage may hold either alone).
    head = getattr(model, "lm_head", None)
    embed_weight = dict(model.named_parameters(remove_duplicate=False)).get(embed)
    tied = isinstance(head, Linear) and head.weight is embed_weight
    from cadence.models.base import fused_pattern

    pattern = fused_pattern(model.fused_parts)
    modules = dict(model.named_modules())
    found: dict[str, dict[int | None, QuantizedWeight]] = {}
    names: dict[str, list[str]] = {}
    for hf_name, weight in weights.items():
        target = _target(model, hf_name, embed, tied, pattern)
        if target is None or not isinstance(modules.get(target[0]), Linear):
            continue
        found.setdefault(target[0], {})[target[1]] = weight
        names.setdefault(target[0], []).append(hf_name)
    attached: set[str] = set()
    for module_name, shards in found.items():
        module = modules[module_name]
        if None not in shards:
            n = len(model.fused_sizes(module_name.rsplit(".", 1)[-1]))
            if sorted(shards) != list(range(n)):
                continue  # a part stayed fp32: the module does too
        # This rank's share of each part (all of it in one process).
        parts = [rank_share(module, i, w) for i, w in sorted(
            shards.items(), key=lambda kv: -1 if kv[0] is None else kv[0])]
        if any(w is None for w in parts):
            logger.warning("%s blocks for %s: this rank's share of the inputs does not "
                           "start and end on whole blocks; it stays fp32", what, module_name)
            continue
        weight = _stack(parts)
        # Checked in the weight's dtype: a 16-bit model holds the dequantized values rounded
        # to it (the CUDA backend's bf16 and fp16; fp32 elsewhere, where this is exact).
        dense = module.weight.detach()
        if weight.shape != dense.shape or (verify and not torch.equal(
                weight.dequantize().to(dense.dtype), dense)):
            logger.warning("%s blocks for %s do not give its weight; it stays fp32", what,
                           module_name)
            continue
        module.quantized = weight
        attached.update(names[module_name])
    return attached


def materialize(model: nn.Module) -> None:
    """Write every quantized linear's fp32 weight from its quantized values and drop them:
    for a backend that does not run them (where a packed checkpoint's linears were never
    written in fp32)."""
    for module in model.modules():
        weight = getattr(module, "quantized", None)
        if isinstance(module, Linear) and weight is not None:
            with torch.no_grad():
                module.weight.copy_(weight.dequantize())
            del module.quantized


def quantize_int8(weight: torch.Tensor, group: int = INT8_GROUP) -> QuantizedWeight:
    """Symmetric int8 with one fp32 scale per ``group`` inputs of each output:
    s = max |w| / 127 over the group, q = round(w / s)."""
    n, k = weight.shape
    if k % group:
        group = k
    w = weight.detach().float().reshape(n, k // group, group)
    scale = w.abs().amax(dim=2) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
    q = torch.round(w / scale.unsqueeze(2)).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q.reshape(n, k), scale.contiguous(), None)


def attach_int8(model: nn.Module) -> int:
    """Give every linear of ``model`` an int8 ``quantized`` weight, the LM head's included (as
    llama.cpp's Q8_0 files store it: at a small model's decode the head is a fifth of the
    weight bytes, and in fp32 it would stream as many bytes as all the int8 layers), but
    not those a model marks ``keep_unquantized`` (mixture-of-experts routers); returns how
    many. A tied head's embedding table stays as it was."""
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and not getattr(module, "keep_unquantized", False):
            _check_int8_share(name, module)
            module.quantized = quantize_int8(module.weight)
            count += 1
    return count


def _check_int8_share(name: str, module: Linear) -> None:
    """A row-parallel rank rounds its share of each row (``check_int8_split``); the config
    was checked before any rank loaded, this holds for whatever built it."""
    if isinstance(module, RowParallelLinear) and module.tp_size > 1:
        check_int8_split(f"{name} has", module.in_features * module.tp_size, module.tp_size)
