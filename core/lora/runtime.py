"""The model side of LoRA: the wrapped layers, the adapters loaded (least recently used
dropped beyond ``max_cpu_loras``), and each step's ``LoRAStep``: which rows run which
adapter. Created by ``ModelRunner.load_model`` when the engine serves adapters."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

import torch
from torch import nn

from cadence.backend import ModelInput
from cadence.config import EngineConfig
from cadence.distributed import all_reduce
from cadence.layers import sampler
from cadence.layers.linear import linear
from cadence.lora.adapter import read_adapter
from cadence.lora.layers import LoRALinear, wrap_model
from cadence.lora.weights import (
    GemmFactory,
    LayerUpdate,
    StackedUpdate,
    load_adapter,
    stack_updates,
)


class UpdateKernels(Protocol):
    """A backend's own kernels for the expand half of the updates, added in place
    (``LoRAManager.kernels``; the CPU backend's: backends/cpu/lora.py). Each row must get
    ``t[row, cols] @ B[:, cols].T`` over its own adapter's columns only, whatever else is in
    the batch."""

    def prepare(self, b: torch.Tensor) -> Any:
        """B of a stacked layer ([out, columns], the model's dtype), as the kernel takes it
        (once per set of adapters)."""
        ...

    def expand_add(self, y: torch.Tensor, t: torch.Tensor, prepared: Any, step: LoRAStep,
                   update: StackedUpdate) -> None:
        """``y += `` the rows' updates, in place, from the shrink's output ``t``; ``step``
        gives each row's columns (``columns``) or a 0/1 mask of them (``mask``)."""
        ...


def torch_gemm(weight: torch.Tensor):
    """The default GEMM of an update: torch's, rows padded as every CPU GEMM's are
    (cadence.layers.linear). A backend with batch-invariant GEMMs of its own passes those
    (``LoRAManager.make_gemm``), so a row's update never depends on the batch."""
    return lambda x: linear(x, weight)


class LoRAStep:
    """One step's adapters: per wrapped layer their stacked update, and per token row the
    index of its adapter among them (the base model's rows: one past the last). Each row
    takes its own adapter's columns of the shrink only, through the backend's kernels or
    through a 0/1 mask on the columns before the expand GEMM; masks and column tables are
    built once per step and column layout. ``order`` lists the rows sorted by adapter."""

    __slots__ = ("cache", "kernels", "order", "row_owner", "updates")

    def __init__(self, updates: dict[str, StackedUpdate], row_owner: torch.Tensor,
                 order: torch.Tensor | None, kernels: UpdateKernels | None) -> None:
        self.updates = updates
        self.row_owner = row_owner
        self.order = order
        self.kernels = kernels
        self.cache: dict[tuple, object] = {}

    def mask(self, owner: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """[rows, columns]: 1 where the column belongs to the row's adapter."""
        mask = self.cache.get(owner)
        if mask is None:
            # Through pinned memory on a GPU (built mid-forward: never wait for the stream).
            cols = sampler.host_tensor(list(owner), torch.int64, self.row_owner.device)
            mask = self.cache[owner] = (self.row_owner[:, None] == cols[None, :]).to(dtype)
        return mask

    def columns(self, spans: tuple[tuple[int, int], ...]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the first of its adapter's columns and their count (0: none)."""
        cols = self.cache.get(spans)
        if cols is None:
            dev = self.row_owner.device
            first = torch.tensor([s for s, _ in spans] + [0], dtype=torch.int64, device=dev)
            count = torch.tensor([w for _, w in spans] + [0], dtype=torch.int64, device=dev)
            cols = self.cache[spans] = (first[self.row_owner], count[self.row_owner])
        return cols

    def apply(self, layer: LoRALinear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        update = self.updates.get(layer.key)
        if update is None:
            return y
        t = update.shrink(x)
        if layer.reduce_shrink:
            t = all_reduce(t)
        if self.kernels is not None:
            self.kernels.expand_add(y, t, update.prepared, self, update)
            return y
        # In place: y is the base layer's own fresh output. A new [tokens, out] tensor per
        # layer cost more than the GEMMs at a 2048-token prefill chunk.
        return y.add_(update.expand(t.mul_(self.mask(update.owner, t.dtype))))


class LoRAManager:
    """Wraps the model's projections at load and serves each step its adapters."""

    def __init__(self, config: EngineConfig, model: nn.Module, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = config
        self.lora_config = config.lora_config
        self.layers = wrap_model(model)
        self.body = getattr(model, "_body", "model")
        self.dtype, self.device = dtype, device
        self.make_gemm: GemmFactory = torch_gemm
        # A backend's kernels for the expand (``UpdateKernels``); None: the masked expand
        # GEMM and an add.
        self.kernels: UpdateKernels | None = None
        # (id, folder) -> updates, most recently used last.
        self._loaded: OrderedDict[tuple[int, str], dict[str, LayerUpdate]] = OrderedDict()
        # The stacked updates of the last few sets of adapters a step ran with: a set
        # usually runs for many steps in a row.
        self._stacks: OrderedDict[tuple[tuple[int, str], ...], dict[str, StackedUpdate]] = \
            OrderedDict()

    @property
    def num_loaded(self) -> int:
        return len(self._loaded)

    def _updates(self, key: tuple[int, str], keep: set[tuple[int, str]]
                 ) -> dict[str, LayerUpdate]:
        updates = self._loaded.get(key)
        if updates is not None:
            self._loaded.move_to_end(key)
            return updates
        spec = read_adapter(key[1], self.config.model_config.model,
                            self.lora_config.max_lora_rank)
        updates = load_adapter(spec, self.layers, self.body, self.dtype, self.device)
        self._loaded[key] = updates
        limit = self.lora_config.num_resident
        for old in list(self._loaded):
            if len(self._loaded) <= limit:
                break
            if old not in keep:
                del self._loaded[old]
                for combo in [c for c in self._stacks if old in c]:
                    del self._stacks[combo]
        return updates

    def _stacked(self, combo: tuple[tuple[int, str], ...]) -> dict[str, StackedUpdate]:
        stacked = self._stacks.get(combo)
        if stacked is not None:
            self._stacks.move_to_end(combo)
            for key in combo:  # they ran: least recently used is by step, not by load
                self._loaded.move_to_end(key)
            return stacked
        keep = set(combo)
        stacked = stack_updates([self._updates(key, keep) for key in combo], self.make_gemm,
                                self.kernels.prepare if self.kernels is not None else None)
        self._stacks[combo] = stacked
        while len(self._stacks) > _MAX_STACKS:
            self._stacks.popitem(last=False)
        return stacked

    def step(self, mi: ModelInput) -> LoRAStep | None:
        """The step's adapters, loading those not loaded yet; None when no row has one."""
        if not mi.lora_ids:
            return None
        # Sorted: the same set of adapters is the same stack whatever the rows' order.
        combo = tuple(sorted((i, mi.lora_paths[i]) for i in set(mi.lora_ids) if i))
        if not combo:
            return None
        # Per token row, its adapter's index in the combo; the base model's rows take the
        # last entry of each per-adapter table (one past the adapters).
        index = {key[0]: n for n, key in enumerate(combo)}
        owners: list[int] = []
        runs: list[list[range]] = [[] for _ in range(len(combo) + 1)]
        for lora_id, q in zip(mi.lora_ids, mi.query_lens):
            n = index.get(lora_id, len(combo))
            runs[n].append(range(len(owners), len(owners) + q))
            owners += [n] * q
        order = None
        if self.kernels is not None:  # only the kernels read it: the rows by adapter
            order = [r for per_adapter in runs for run in per_adapter for r in run]
        # Through pinned memory on a GPU: the host never waits for the stream.
        return LoRAStep(self._stacked(combo),
                        sampler.host_tensor(owners, torch.int64, self.device),
                        None if order is None else
                        sampler.host_tensor(order, torch.int64, self.device), self.kernels)

_MAX_STACKS = 8
