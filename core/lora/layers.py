"""The projections an adapter may change, wrapped so a step's adapters add their low-rank
updates to the base layer's output.

``wrap_model`` runs once at load when the engine serves adapters. A ``LoRALinear`` keeps the
base layer as its child ``base`` (a backend that swaps linears for its own GEMMs swaps that
one, and the wrapper keeps working), and asks the forward context for the step's adapters:
with none, it is the base layer plus one attribute read.

NOTE tensor parallel: the update of a column-parallel layer (q/k/v, gate/up) needs this
rank's rows of B, of a row-parallel one (o, down) this rank's columns of A, and the partial
products ``x @ A.T`` summed over the ranks before B (a [tokens, rank] all-reduce). What slices
which is recorded here at wrap time, from the base layer as the checkpoint loader slices it.
"""

from __future__ import annotations

import torch
from torch import nn

from cadence.forward_context import current_lora
from cadence.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear

# Our module per HF projection name (the Llama layout; fused ones hold several parts).
LORA_MODULES = {"self_attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")}


class LoRALinear(nn.Module):
    """A linear layer plus the step's adapters' updates, ``x @ A.T @ B.T`` (the scale folded
    into B) added to the rows that run each adapter (``cadence.lora.runtime.LoRAStep``)."""

    def __init__(self, base: Linear, key: str) -> None:
        super().__init__()
        self.base = base
        self.key = key
        self.in_features, self.out_features = base.in_features, base.out_features
        # Column-parallel: per fused part, (first row in the checkpoint's part, rows here).
        # Row-parallel: this rank's input columns (first, count) of A, and the all-reduce.
        self.part_slices: list[tuple[int, int]] = []
        self.column_slice: tuple[int, int] | None = None
        self.reduce_shrink = False
        if isinstance(base, ColumnParallelLinear):
            self.part_slices = [(base.part_start(p) if base.tp_size > 1 else 0,
                                 base.local_rows(p)) for p in range(len(base.part_sizes))]
        else:
            self.part_slices = [(0, base.out_features)]
            if isinstance(base, RowParallelLinear) and base.tp_size > 1:
                self.column_slice = (base.tp_rank * base.in_features, base.in_features)
                self.reduce_shrink = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = current_lora()
        return y if step is None else step.apply(self, x, y)


def wrap_model(model: nn.Module) -> dict[str, LoRALinear]:
    """Wrap every decoder layer's projections of a Llama-layout model; returns them by
    their module name (``model.layers.3.self_attn.qkv_proj``). Layers of another pipeline
    stage hold no projections and are skipped."""
    wrapped: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        parent_kind = name.rsplit(".", 1)[-1]
        for child in LORA_MODULES.get(parent_kind, ()):
            base = getattr(module, child, None)
            if isinstance(base, Linear):
                key = f"{name}.{child}"
                wrapped[key] = LoRALinear(base, key)
                setattr(module, child, wrapped[key])
    return wrapped
