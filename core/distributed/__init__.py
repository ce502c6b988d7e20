"""The parallel groups this process belongs to, and their communication.

A model built under tensor parallel reads its rank and the group size here (to size its
shard of heads, MLP columns and vocabulary) and calls ``all_reduce``/``all_gather`` where the
shards meet. Under pipeline parallel it reads its stage here (which layers it holds,
``pp_layer_range``) and hands its activations to the next stage with
``send_to_next_stage``/``recv_from_previous_stage``. Which library carries them is the
backend's choice: its ``Backend.init_distributed`` installs a ``Communicator``
(torch.distributed over gloo on the CPU; a plugin may bring its own), so nothing here names
a device library. With no group
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

    def isend(self, x: Any, dst: int) -> Any:
        """Start sending ``x`` to rank ``dst``; returns a handle whose ``wait()`` returns
        once it is sent. ``x`` must not change until then."""
        import torch.distributed as dist

        return dist.isend(_as_bytes(x), dst)

    def recv(self, shape: tuple[int, ...], dtype: Any, src: int) -> Any:
        """A tensor of ``shape`` and ``dtype`` sent by rank ``src``."""
        import torch
        import torch.distributed as dist

        y = torch.empty(shape, dtype=dtype)
        dist.recv(_as_bytes(y), src)
        return y


def _as_bytes(x: Any) -> Any:
    # Point-to-point copies bytes: any dtype travels as its raw bytes (gloo has no bfloat16).
    import torch

    return x.contiguous().reshape(-1).view(torch.uint8)


@dataclass(slots=True)
class _Group:
    rank: int = 0
    size: int = 1
    comm: Communicator | None = None


_group = _Group()  # tensor parallel
_stages = _Group()  # pipeline parallel: rank is this process's stage
_sends: list[Any] = []  # this stage's activations in flight to the next, with their handles


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


def set_pipeline_parallel(stage: int, num_stages: int, comm: Communicator | None) -> None:
    """Make this process stage ``stage`` of ``num_stages``, the stages being ranks 0..N-1 of
    ``comm``'s world (the backend calls it)."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"pipeline stage must be in [0, {num_stages}), got {stage}")
    if num_stages > 1 and comm is None:
        raise ValueError("a pipeline of several stages needs a communicator")
    _stages.rank, _stages.size, _stages.comm = stage, num_stages, comm
    _sends.clear()


def pp_rank() -> int:
    """This process's pipeline stage (0 without pipeline parallel)."""
    return _stages.rank


def pp_size() -> int:
    return _stages.size


def pp_layer_range(num_layers: int, stage: int | None = None,
                   num_stages: int | None = None) -> range:
    """The decoder layers stage ``stage`` (this process's by default) holds: contiguous,
    ``num_layers // num_stages`` each, the first ``num_layers % num_stages`` stages one more.
    ValueError when a stage would hold none."""
    stage = _stages.rank if stage is None else stage
    num_stages = _stages.size if num_stages is None else num_stages
    if num_layers < num_stages:
        raise ValueError(f"--pipeline-parallel-size {num_stages} needs at least one decoder "
                         f"layer per stage; the model has {num_layers} (num_hidden_layers)")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def send_to_next_stage(x: Any) -> None:
    """Hand ``x`` (this stage's output activations) to the next stage without waiting for
    it to take them: this stage goes on with the next micro-batch meanwhile. At most one
    send is left in flight: the one before it is waited for first (the next stage takes
    micro-batches in order, so in a steady pipeline it is long done)."""
    while _sends:
        _sends.pop(0)[1].wait()
    x = x.contiguous()
    _sends.append((x, _stages.comm.isend(x, _stages.rank + 1)))


def recv_from_previous_stage(shape: tuple[int, ...], dtype: Any) -> Any:
    """The previous stage's output activations for the micro-batch this stage runs now."""
    return _stages.comm.recv(shape, dtype, _stages.rank - 1)


def init_torch_distributed(library: str, rank: int, world_size: int, init_method: str,
                           join_timeout: float, pipeline_parallel_size: int = 1) -> None:
    """Join the torch.distributed group ``library`` (gloo, nccl, hccl...) at
    ``init_method`` as ``rank`` and install it: as the tensor-parallel group, or with
    ``pipeline_parallel_size`` > 1 as the pipeline's stages (rank i is stage i). The default
    ``Backend.init_distributed``. Raises RuntimeError naming the rank and the cause."""
    if world_size == 1:
        set_tensor_parallel(0, 1, None)
        set_pipeline_parallel(0, 1, None)
        return
    if pipeline_parallel_size not in (1, world_size):
        raise ValueError(f"pipeline_parallel_size {pipeline_parallel_size} with tensor "
                         f"parallel inside each stage is not supported yet (world size "
                         f"{world_size})")
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.init_process_group(library, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=join_timeout))
    except Exception as e:
        raise RuntimeError(f"rank {rank} of {world_size} could not join the {library} group "
                           f"at {init_method}: {type(e).__name__}: {e}") from e
    if pipeline_parallel_size > 1:
        set_tensor_parallel(0, 1, None)
        set_pipeline_parallel(rank, world_size, Communicator())
    else:
        set_tensor_parallel(rank, world_size, Communicator())
        set_pipeline_parallel(0, 1, None)
