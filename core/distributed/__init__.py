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

Under expert parallel (``set_expert_parallel``) a mixture-of-experts layer holds whole
experts, ``held_experts`` of them per tensor-parallel rank, instead of a slice of each.

Imports no torch at module level: ``import cadence`` stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


class Communicator:
    """The collectives of one tensor-parallel group over torch.distributed.

    ``all_reduce`` sums a tensor over the ranks, ``all_gather`` concatenates the ranks'
    tensors along ``dim`` in rank order; both return a new tensor, equal on every rank.
    A backend whose library is not a torch.distributed backend subclasses this.
    """

    #: dtypes the library reduces natively; others are reduced in float32 (gloo has no
    #: bfloat16 sum). None: by library, ``LIBRARY_DTYPES``.
    native_dtypes: tuple[str, ...] | None = None
    #: NCCL and HCCL sum bfloat16 and float16 themselves (each reduction step rounds its sum
    #: to the dtype), so widening would only double the bytes on the wire, where tensor
    #: parallel on GPUs spends its time. Two ranks' sum is the same either way.
    LIBRARY_DTYPES: ClassVar[dict[str, tuple[str, ...]]] = {
        "nccl": ("float32", "bfloat16", "float16"),
        "hccl": ("float32", "bfloat16", "float16")}

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def _wide(self, x: Any) -> Any:
        native = self.native_dtypes
        if native is None:
            import torch.distributed as dist

            native = self.LIBRARY_DTYPES.get(str(dist.get_backend(self.group)), ("float32",))
            self.native_dtypes = native
        return x if str(x.dtype).removeprefix("torch.") in native else x.float()

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
        """A tensor of ``shape`` and ``dtype`` sent by rank ``src``, in the memory the
        library moves: the host's for a library that carries it (gloo), else its device's
        (NCCL: the current CUDA device, which the backend set to this rank's GPU)."""
        import torch
        import torch.distributed as dist

        devices = dist.Backend.backend_capability.get(dist.get_backend(self.group), ["cpu"])
        y = torch.empty(shape, dtype=dtype, device="cpu" if "cpu" in devices else devices[0])
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
    stride: int = 1  # pipeline: global ranks from a stage's rank to its peer in the next


_group = _Group()  # tensor parallel
_stages = _Group()  # pipeline parallel: rank is this process's stage
_sends: list[Any] = []  # this stage's activations in flight to the next, with their handles
EXPERT_PLACEMENTS = ("linear", "round_robin")
# "held": what the last model built here holds under expert parallel, for its env info.
_experts: dict[str, Any] = {"enabled": False, "placement": "linear", "held": None}


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


def set_expert_parallel(enabled: bool, placement: str = "linear") -> None:
    """Split mixture-of-experts layers by whole experts over the tensor-parallel ranks
    (``enabled``) instead of splitting every expert; ``placement`` says which experts a
    rank holds (``held_experts``). Read when a model is built."""
    if placement not in EXPERT_PLACEMENTS:
        raise ValueError(f"expert placement must be one of {EXPERT_PLACEMENTS}, "
                         f"got {placement!r}")
    _experts["enabled"], _experts["placement"] = bool(enabled), placement
    _experts["held"] = None


def ep_size() -> int:
    """Ranks the experts are spread over: the tensor-parallel group's size under expert
    parallel, else 1 (every rank holds a slice of every expert)."""
    return _group.size if _experts["enabled"] else 1


def held_experts(num_experts: int) -> list[int]:
    """The experts (global indices, ascending) this rank holds whole: every one without
    expert parallel. ``linear`` gives each rank a contiguous run, ``num_experts // size``
    each and the first ``num_experts % size`` ranks one more (vLLM's default placement);
    ``round_robin`` gives rank r the experts r, r + size, ... (neighbours in index apart,
    for models whose popular experts cluster). ValueError when a rank would hold none."""
    size = ep_size()
    if size == 1:
        return list(range(num_experts))
    if num_experts < size:
        raise ValueError(f"expert parallel over {size} ranks needs at least one expert per "
                         f"rank; the model has {num_experts} experts per layer")
    rank = _group.rank
    if _experts["placement"] == "round_robin":
        held = list(range(rank, num_experts, size))
    else:
        held = list(even_share(num_experts, rank, size))
    _experts["held"] = f"{','.join(map(str, held))} of {num_experts}"
    return held


def experts_held() -> str | None:
    """"i,j,... of E": the experts per layer this rank's model holds under expert parallel
    (None without it, or before a mixture-of-experts model was built)."""
    return _experts["held"]


def set_pipeline_parallel(stage: int, num_stages: int, comm: Communicator | None,
                          stride: int = 1) -> None:
    """Make this process stage ``stage`` of ``num_stages`` (the backend calls it). The
    stage's peers are ranks of ``comm``'s world: this process's rank is
    ``stage * stride`` plus its tensor-parallel rank, so the previous and next stages'
    peers with the same tensor-parallel rank are ``stride`` below and above it (``stride``
    is the tensor-parallel size; 1 without tensor parallel inside the stages)."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"pipeline stage must be in [0, {num_stages}), got {stage}")
    if num_stages > 1 and comm is None:
        raise ValueError("a pipeline of several stages needs a communicator")
    if stride < 1:
        raise ValueError(f"pipeline stride must be >= 1, got {stride}")
    _stages.rank, _stages.size, _stages.comm, _stages.stride = stage, num_stages, comm, stride
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
    return even_share(num_layers, stage, num_stages)


def even_share(count: int, index: int, parts: int) -> range:
    """Part ``index`` of ``count`` items split in ``parts`` contiguous runs, the first
    ``count % parts`` one longer: a stage's layers, a rank's experts, a rank's cores."""
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


def send_to_next_stage(x: Any) -> None:
    """Hand ``x`` (this stage's output activations) to the next stage without waiting for
    it to take them: this stage goes on with the next micro-batch meanwhile. At most one
    send is left in flight: the one before it is waited for first (the next stage takes
    micro-batches in order, so in a steady pipeline it is long done)."""
    while _sends:
        _sends.pop(0)[1].wait()
    x = x.contiguous()
    _sends.append((x, _stages.comm.isend(x, _global_rank() + _stages.stride)))


def recv_from_previous_stage(shape: tuple[int, ...], dtype: Any) -> Any:
    """The previous stage's output activations for the micro-batch this stage runs now."""
    return _stages.comm.recv(shape, dtype, _global_rank() - _stages.stride)


def _global_rank() -> int:
    return _stages.rank * _stages.stride + _group.rank


def init_torch_distributed(library: str, rank: int, world_size: int, init_method: str,
                           join_timeout: float, pipeline_parallel_size: int = 1) -> None:
    """Join the torch.distributed group ``library`` (gloo, nccl, hccl...) at
    ``init_method`` as ``rank`` and install it. The world is ``pipeline_parallel_size``
    stages of ``world_size // pipeline_parallel_size`` tensor-parallel ranks, stage-major
    (``ParallelConfig.rank``): each stage's ranks form a tensor-parallel group of their own,
    and activations go from a rank to the rank with the same tensor-parallel index in the
    next stage. The default ``Backend.init_distributed``. Raises RuntimeError naming the
    rank and the cause."""
    if world_size == 1:
        set_tensor_parallel(0, 1, None)
        set_pipeline_parallel(0, 1, None)
        return
    if pipeline_parallel_size < 1 or world_size % pipeline_parallel_size:
        raise ValueError(f"world size {world_size} is not a whole number of "
                         f"{pipeline_parallel_size} pipeline stages")
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.init_process_group(library, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=join_timeout))
    except Exception as e:
        raise RuntimeError(f"rank {rank} of {world_size} could not join the {library} group "
                           f"at {init_method}: {type(e).__name__}: {e}") from e
    tp = world_size // pipeline_parallel_size
    stage, tp_rank = divmod(rank, tp)
    group = None  # the default group: the whole world, without pipeline stages
    if pipeline_parallel_size > 1 and tp > 1:
        # Every rank creates every stage's group, in the same order (torch.distributed
        # requires it), and keeps its own.
        for s in range(pipeline_parallel_size):
            g = dist.new_group(list(range(s * tp, (s + 1) * tp)))
            if s == stage:
                group = g
    set_tensor_parallel(tp_rank, tp, Communicator(group) if tp > 1 else None)
    set_pipeline_parallel(stage, pipeline_parallel_size,
                          Communicator() if pipeline_parallel_size > 1 else None, stride=tp)
