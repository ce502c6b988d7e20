"""The tensor-parallel group this process belongs to, and its collectives.

A model built under tensor parallel reads its rank and the group size here (to size its
shard of heads, MLP columns and vocabulary) and calls ``all_reduce``/``all_gather`` where the
shards meet. Which library carries the collectives is the backend's choice: its
``Backend.init_distributed`` installs a ``Communicator`` (torch.distributed over gloo on the
CPU; a plugin may bring its own), so nothing here names a device library. With no group
installed (one process, the default) the rank is 0 of 1 and the collectives are identities.

Imports no torch at module level: ``import cadence`` stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class Communicator:
    """The collectives of one tensor-parallel group over torch.distributed.

    ``all_reduce`` sums a tensor over the ranks, ``all_gather`` concatenates the ranks'
    tensors along ``dim`` in rank order; both return a new tensor, equal on every rank.
    A backend whose library is not a torch.distributed backend subclasses this.
    """

    #: dtypes the library reduces natively; others are reduced in float32 (gloo has no
    #: bfloat16 sum, and summing shards in fp32 is the more accurate choice anyway).
    native_dtypes: tuple[str, ...] = ("float32",)

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def _wide(self, x: Any) -> Any:
        return x if str(x.dtype).removeprefix("torch.") in self.native_dtypes else x.float()

    def all_reduce(self, x: Any) -> Any:
        import torch.distributed as dist

        y = self._wide(x).clone()
        dist.all_reduce(y, group=self.group)
        return y.to(x.dtype)

    def all_gather(self, x: Any, dim: int = -1) -> Any:
        import torch
        import torch.distributed as dist

        y = self._wide(x).contiguous()
        parts = [torch.empty_like(y) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat(parts, dim=dim).to(x.dtype)


@dataclass(slots=True)
class _Group:
    rank: int = 0
    size: int = 1
    comm: Communicator | None = None


_group = _Group()


def set_tensor_parallel(rank: int, size: int, comm: Communicator | None) -> None:
    """Make this process rank ``rank`` of a group of ``size`` (the backend calls it)."""
    if not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank must be in [0, {size}), got {rank}")
    if size > 1 and comm is None:
        raise ValueError("a tensor parallel group of several ranks needs a communicator")
    _group.rank, _group.size, _group.comm = rank, size, comm


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def all_reduce(x: Any) -> Any:
    """Sum of ``x`` over the tensor-parallel ranks (``x`` itself in a group of one)."""
    return x if _group.size == 1 else _group.comm.all_reduce(x)


def all_gather(x: Any, dim: int = -1) -> Any:
    """The ranks' ``x`` concatenated along ``dim`` (``x`` itself in a group of one)."""
    return x if _group.size == 1 else _group.comm.all_gather(x, dim)


def init_torch_distributed(library: str, rank: int, world_size: int, init_method: str,
                           join_timeout: float) -> None:
    """Join the torch.distributed group ``library`` (gloo, nccl, hccl...) at
    ``init_method`` as ``rank`` and install it as the tensor-parallel group. The default
    ``Backend.init_distributed``. Raises RuntimeError naming the rank and the cause."""
    if world_size == 1:
        set_tensor_parallel(0, 1, None)
        return
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.init_process_group(library, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=join_timeout))
    except Exception as e:
        raise RuntimeError(f"rank {rank} of {world_size} could not join the {library} group "
                           f"at {init_method}: {type(e).__name__}: {e}") from e
    set_tensor_parallel(rank, world_size, Communicator())
