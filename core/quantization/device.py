"""Quantized linears on a device backend: the steps every backend whose model moves to a
device takes around that move (the CUDA backend's Triton GEMM, the HPU backend's
dequantizing linear).

The loader leaves a ``quantized`` attribute (a ``QuantizedWeight``) on each linear it runs
compressed. Before the model moves, ``drop_dense_weights`` replaces each such linear's dense
weight by an empty tensor, so the model's full-size linears never take device memory (for
a packed or GGUF checkpoint it was never even written), except where the backend asks for
the dense weight instead (``run_dense``). After the move, and after LoRA wrapped the
projections, ``swap_quantized`` replaces every such linear, a LoRA wrapper's ``base``
included, by the backend's own module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn

from cadence.layers.linear import Linear

logger = logging.getLogger(__name__)


def quantized_linears(model: nn.Module) -> Iterator[Linear]:
    for module in model.modules():
        if isinstance(module, Linear) and getattr(module, "quantized", None) is not None:
            yield module


def run_dense(module: Linear) -> None:
    """Give ``module`` its dense weight, written from its quantized one, and drop that."""
    # A weight of its own, not a copy into the one it has: a tied head's is the embedding
    # table, which the lookup reads as the checkpoint holds it.
    module.weight = nn.Parameter(module.quantized.dequantize().to(module.weight.dtype),
                                 requires_grad=False)
    del module.quantized


def drop_dense_weights(model: nn.Module,
                       dense_reason: Callable[[Linear], str | None] | None = None) -> None:
    """Before the move (module docstring). ``dense_reason(linear)``: why that linear must
    run its dense weight on this backend (logged), or None to drop it."""
    for module in list(quantized_linears(model)):
        reason = dense_reason(module) if dense_reason is not None else None
        if reason is not None:
            if reason:
                logger.warning("%s", reason)
            run_dense(module)
            continue
        # A tied head's weight is the embedding table, which the lookup still needs: the
        # head's own reference is dropped, not the table.
        module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)


def swap_quantized(model: nn.Module, make: Callable[[Linear], nn.Module]) -> list[nn.Module]:
    """After the move (module docstring): every linear with a ``quantized`` weight becomes
    ``make(linear)``; returns the new modules."""
    made = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear) and getattr(child, "quantized", None) is not None:
                layer = make(child)
                setattr(parent, name, layer)
                made.append(layer)
    return made


def dequantized_rows(q_rows: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                     group: int, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of a weight in fp32, ``s * q + o``, from those rows' int8 values
    ``q_rows``: what a 16-bit LM head's tie refinement reads of a compressed head
    (core/layers/logits.py). No host sync, so a captured graph may run it."""
    rows = scale.index_select(0, index).repeat_interleave(group, dim=1) * q_rows.float()
    if offset is not None:
        rows = rows + offset.index_select(0, index).repeat_interleave(group, dim=1)
    return rows


class RowsOf:
    """A compressed weight as the tie refinement reads it: ``index_select(0, rows)``."""

    def __init__(self, read: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._read = read

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        assert dim == 0, "the tie refinement reads rows"
        return self._read(index)
