"""Linear layers whose rows do not depend on the rest of the batch.

NOTE batch invariance: torch's CPU GEMM computes rows in groups of 4 and finishes a partial
group with a different kernel, so a row's bits depend on its index and the batch size
(measured here on AVX2: rows equal across batch sizes only inside full groups). A request's
logits would then change with whatever else is in the batch, and async output processing
(which keeps a stop-string request in the batch one step longer) could not match sync mode
exactly. Padding the rows to a multiple of ``ROW_ALIGN`` puts every row in a full group.
The cost is at most three extra rows per matmul. Where even that is not enough (on an AMX
Xeon, ``F.linear``'s rows differ between batches of 8 and 64, and in fp32 for a 576 -> 1536
weight also between batches of 64 and 256: no padding fixes that), the CPU backend's GEMM
choice checks every candidate kernel and takes one that passes (backends/cpu/linear.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cadence.distributed import all_reduce, tp_rank, tp_size

ROW_ALIGN = 4


def row_aligned(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``gemm(x)`` with x's rows padded to a multiple of ``ROW_ALIGN`` (module NOTE); every
    CPU GEMM kernel goes through this unless its rows never read each other at any count
    (the CPU backend's AMX tile loop)."""
    m = x.shape[0]
    pad = -m % ROW_ALIGN
    if pad == 0:
        return gemm(x)
    return gemm(torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))]))[:m]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    return row_aligned(lambda rows: F.linear(rows, weight, bias), x)


class Linear(nn.Linear):
    """``nn.Linear`` over a flat [tokens, features] input, batch-invariant on the CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


# -- tensor parallel (docs/distributed.md) ----------------------------------------------------
# Each layer is built at its rank's size and slices the full checkpoint tensor it is loaded
# from (``tp_load``, called by ``CausalLM.load_weights``); with one rank they are the plain
# layers above. They stay ``Linear``s, so a backend that swaps Linears for its own GEMM
# (the CPU backend's packed weights) keeps the split; a row-parallel layer's sum over the
# ranks is marked by ``reduce_output`` for such a replacement to keep too.


class ColumnParallelLinear(Linear):
    """Output features split across ranks, no communication: rank r holds its slice of
    every part of a fused projection (``part_sizes``, full widths; one part by default)."""

    reduce_output = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 part_sizes: list[int] | None = None) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.part_sizes = part_sizes or [out_features]
        if sum(self.part_sizes) != out_features:
            raise ValueError(f"parts {self.part_sizes} do not add up to {out_features}")
        # The parts' rows in a checkpoint that stores them fused (see ``tp_load``).
        self.checkpoint_sizes = self.part_sizes
        super().__init__(in_features, sum(self.local_rows(i) for i in
                                          range(len(self.part_sizes))), bias=bias)

    def local_rows(self, part: int) -> int:
        """Rows of fused part ``part`` on this rank."""
        return -(-self.part_sizes[part] // self.tp_size)

    def part_start(self, part: int) -> int:
        """Where this rank's rows of part ``part`` start in the checkpoint tensor."""
        return self.tp_rank * self.local_rows(part)

    def tp_load(self, kind: str, part: int | None, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the checkpoint tensor of ``part`` (weight or bias), zero
        padded when the full width does not divide (a vocabulary). ``part`` None on a fused
        layer: the checkpoint stores every part in one tensor (Phi-3's ``qkv_proj``, GPT-2's
        ``c_attn``), so this rank's rows of each, in order."""
        if self.tp_size == 1:
            return tensor
        if part is None and len(self.part_sizes) > 1:
            if tensor.shape[0] != sum(self.checkpoint_sizes):
                raise ValueError(f"a fused checkpoint tensor of {tensor.shape[0]} rows, the "
                                 f"layer expects parts of {self.checkpoint_sizes}")
            pieces = tensor.split(self.checkpoint_sizes)
            return torch.cat([self.tp_load(kind, i, p) for i, p in enumerate(pieces)])
        part = part or 0
        rows, start = self.local_rows(part), self.part_start(part)
        out = tensor[start:start + rows]
        if out.shape[0] < rows:
            pad = tensor.new_zeros((rows - out.shape[0],) + tuple(tensor.shape[1:]))
            out = torch.cat([out, pad])
        return out


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v with the heads split across ranks; KV heads replicated when there are
    fewer than ranks (each rank then holds the one its query heads read)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False) -> None:
        self.head_dim = head_dim
        self.kv_replicas = max(1, tp_size() // num_kv_heads)
        kv = num_kv_heads * head_dim * self.kv_replicas
        super().__init__(hidden, num_heads * head_dim + 2 * kv, bias,
                         [num_heads * head_dim, kv, kv])
        self.checkpoint_sizes = [num_heads * head_dim] + [num_kv_heads * head_dim] * 2

    def part_start(self, part: int) -> int:
        if part == 0 or self.kv_replicas == 1:
            return super().part_start(part)
        return (self.tp_rank // self.kv_replicas) * self.head_dim


class RowParallelLinear(Linear):
    """Input features split across ranks; the partial outputs are summed over the ranks.
    The bias is rank 0's alone (zeros elsewhere), so the sum adds it once. ``reduce=False``
    leaves the sum to the caller, which adds several partial outputs first and reduces
    once (a mixture of experts: one all-reduce per layer, not one per expert)."""

    reduce_output = True

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 reduce: bool = True) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        super().__init__(in_features // self.tp_size, out_features, bias=bias)
        self.reduce_output = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return all_reduce(y) if self.reduce_output else y

    def tp_load(self, kind: str, part: int | None, tensor: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return tensor
        if kind == "bias":
            return tensor if self.tp_rank == 0 else torch.zeros_like(tensor)
        cols = self.in_features
        return tensor[:, self.tp_rank * cols:(self.tp_rank + 1) * cols]


class VocabParallelEmbedding(nn.Embedding):
    """The embedding table split by vocabulary rows across ranks (padded to divide): each
    rank looks up the ids in its range, zeros for the others, and the sum over the ranks is
    the full lookup."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        rows = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * rows
        # _weight skips the random init (load_weights fills it).
        super().__init__(rows, dim, _weight=torch.empty(rows, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.masked_fill(~mine, 0), self.weight)
        return all_reduce(out.masked_fill(~mine.unsqueeze(-1), 0))

    def tp_load(self, kind: str, part: int | None, tensor: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return tensor
        out = tensor[self.vocab_start:self.vocab_start + self.num_embeddings]
        if out.shape[0] < self.num_embeddings:
            pad = tensor.new_zeros((self.num_embeddings - out.shape[0], tensor.shape[1]))
            out = torch.cat([out, pad])
        return out
