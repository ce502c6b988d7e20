"""The model side of LoRA: the wrapped layers, the adapters loaded (least recently used
dropped beyond ``max_cpu_loras``), and each step's ``LoRAStep``: which rows run which
adapter. Created by ``ModelRunner.load_model`` when the engine serves adapters."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from cadence.backend import ModelInput
from cadence.config import EngineConfig
from cadence.distributed import all_reduce
from cadence.layers import sampler
from cadence.layers.linear import linear
from cadence.lora.adapter import read_adapter
from cadence.lora.layers import LoRALinear, wrap_model
from cadence.lora.weights import GemmFactory, LayerUpdate, load_adapter


def torch_gemm(weight: torch.Tensor):
    """The default GEMM of an update: torch's, rows padded as every CPU GEMM's are
    (cadence.layers.linear). A backend with batch-invariant GEMMs of its own passes those
    (``LoRAManager.make_gemm``), so a row's update never depends on the batch."""
    return lambda x: linear(x, weight)


class LoRAStep:
    """One step's adapters: per adapter, its updates and the token rows that run it (None:
    every row of the step)."""

    __slots__ = ("groups",)

    def __init__(self, groups: list[tuple[dict[str, LayerUpdate], torch.Tensor | None]]):
        self.groups = groups

    def apply(self, layer: LoRALinear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for updates, rows in self.groups:
            update = updates.get(layer.key)
            if update is None:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            t = update.shrink(xs)
            if layer.reduce_shrink:
                t = all_reduce(t)
            d = update.expand(t).to(y.dtype)
            if rows is None:
                y = y + d
            else:
                y = y.index_add(0, rows, d)
        return y


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
        # (id, folder) -> updates, most recently used last.
        self._loaded: OrderedDict[tuple[int, str], dict[str, LayerUpdate]] = OrderedDict()

    @property
    def num_loaded(self) -> int:
        return len(self._loaded)

    def _updates(self, lora_id: int, path: str, keep: set[tuple[int, str]]
                 ) -> dict[str, LayerUpdate]:
        key = (lora_id, path)
        updates = self._loaded.get(key)
        if updates is not None:
            self._loaded.move_to_end(key)
            return updates
        spec = read_adapter(path, self.config.model_config.model,
                            self.lora_config.max_lora_rank)
        updates = load_adapter(spec, self.layers, self.body, self.dtype, self.device,
                               self.make_gemm)
        self._loaded[key] = updates
        limit = self.lora_config.num_resident
        for old in list(self._loaded):
            if len(self._loaded) <= limit:
                break
            if old not in keep:
                del self._loaded[old]
        return updates

    def step(self, mi: ModelInput) -> LoRAStep | None:
        """The step's adapters, loading those not loaded yet; None when no row has one."""
        if not mi.lora_ids:
            return None
        keep = {(i, p) for i, p in mi.lora_paths.items()}
        rows: dict[int, list[int]] = {}
        start = 0
        for lora_id, q in zip(mi.lora_ids, mi.query_lens):
            if lora_id:
                rows.setdefault(lora_id, []).extend(range(start, start + q))
            start += q
        groups = []
        for lora_id, ids in rows.items():
            updates = self._updates(lora_id, mi.lora_paths[lora_id], keep)
            # Through pinned memory on a GPU: the host never waits for the stream.
            index = None if len(ids) == start else \
                sampler.host_tensor(ids, torch.int64, self.device)
            groups.append((updates, index))
        return LoRAStep(groups) if groups else None
