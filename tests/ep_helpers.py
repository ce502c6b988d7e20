"""Run a mixture-of-experts layer as one expert-parallel rank inside this process: the
distributed state set to rank r of n with expert parallel on, the layer built at that
rank's share and loaded from a one-process layer's weights, and the sum over the ranks left
out, so each rank's partial output can be checked (their sum is the whole layer's)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from cadence.distributed import set_expert_parallel, set_tensor_parallel
from cadence.layers.moe import SparseMoE, expert_parallel_share


class PartialSums:
    """A communicator whose sum over the ranks is the identity: a rank keeps its part."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@contextmanager
def as_rank(rank: int, size: int, placement: str = "linear") -> Iterator[None]:
    set_tensor_parallel(rank, size, PartialSums())
    set_expert_parallel(True, placement)
    try:
        yield
    finally:
        set_tensor_parallel(0, 1, None)
        set_expert_parallel(False)


def rank_share(full: SparseMoE, hidden: int, intermediate: int,
               shared: int | None) -> SparseMoE:
    """``full``'s layer as the current rank builds it (call inside ``as_rank``), holding
    its experts whole and its slice of the shared expert, copied from ``full``."""
    part = SparseMoE(hidden, intermediate, full.num_experts, full.top_k, full.renormalize,
                     full.weights_in_model_dtype, shared,
                     held=expert_parallel_share(full.num_experts))
    source = dict(full.named_parameters())
    with torch.no_grad():
        for name, param in part.named_parameters():
            module_name, _, kind = name.rpartition(".")
            tensor = source[name]
            tp_load = getattr(part.get_submodule(module_name), "tp_load", None)
            if tp_load is not None:
                tensor = tp_load(kind, None, tensor)
            param.copy_(tensor)
    return part.to(full.gate.weight.device)
