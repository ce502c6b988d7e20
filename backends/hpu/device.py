"""The thin layer over habana_frameworks, and its emulation on the CPU.

Everything the HPU backend asks of the Gaudi software stack goes through one of two classes
with the same methods, so the backend's own code paths (bucketing, padding, the lazy-mode
call order) run unchanged in emulation:

- ``HabanaDevice``: ``htcore.mark_step()``, ``wrap_in_hpu_graph``, the graph-compilation
  counter from ``habana_frameworks.torch.hpu.metrics``. Imported only when the HPU backend
  is constructed, never by the probe.
- ``EmulatedDevice`` (``CADENCE_HPU_EMULATE=1``, a test aid): CPU tensors, a no-op
  ``mark_step``, an identity graph wrapper. Its compile counter counts distinct input shapes
  per wrapped graph, which is what a Gaudi compiles one graph for, so "no new graph after
  warmup" is checkable on the CPU for the bucketing logic (not for the device itself).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from cadence.backends.hpu.backend import EMULATE_ENV, emulation_requested

__all__ = ["EMULATE_ENV", "EmulatedDevice", "HabanaDevice", "emulation_requested", "make_device"]

logger = logging.getLogger(__name__)


def lazy_mode_requested() -> bool:
    # The bridge's own default is lazy mode; the plugin sets PT_HPU_LAZY_MODE=1 if unset.
    return os.environ.get("PT_HPU_LAZY_MODE", "1").strip() != "0"


def _shape_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)


class _ShapeRecordingGraph:
    """Identity "HPU graph": calls the module and records each new input-shape signature."""

    def __init__(self, module: Callable[..., Any], name: str, seen: set[tuple[Any, ...]]):
        self.module = module
        self.name = name
        self._seen = seen

    def __call__(self, *args: Any) -> Any:
        self._seen.add((self.name, *_shape_key(args)))
        return self.module(*args)


class EmulatedDevice:
    """HPU emulation on CPU tensors; see the module docstring. Not a fallback."""

    name = "hpu-emulated"
    is_emulated = True

    def __init__(self, lazy: bool) -> None:
        self.torch_device = torch.device("cpu")
        self.lazy = lazy
        self.num_mark_steps = 0
        self._seen: set[tuple[Any, ...]] = set()

    def mark_step(self) -> None:
        self.num_mark_steps += 1

    def wrap_graph(self, module: Callable[..., Any], name: str,
                   capturable: bool = True) -> Callable[..., Any]:
        # Recorded either way: lazy mode compiles one graph per shape with or without HPU
        # graphs on top, so the count stays what a Gaudi compiles.
        return _ShapeRecordingGraph(module, name, self._seen)

    def note_graph(self, name: str, *args: Any) -> None:
        """Record a lazily traced (unwrapped) graph, e.g. the sampler, by its input shapes."""
        self._seen.add((name, *_shape_key(args)))

    def num_compiles(self) -> int:
        return len(self._seen)

    def synchronize(self) -> None:
        """CPU ops are synchronous: nothing to wait for."""

    def env_info(self) -> dict[str, str]:
        return {"hpu_emulated": "1", "hpu_lazy_mode": str(int(self.lazy))}


class HabanaDevice:
    """A real Gaudi through habana_frameworks (acquires the device on construction)."""

    name = "hpu"
    is_emulated = False

    def __init__(self, lazy: bool) -> None:
        # Importing the bridge acquires the device, which is exclusive per process: this is
        # why neither the plugin module nor probe() may do it.
        import habana_frameworks.torch as htorch
        import habana_frameworks.torch.core as htcore

        self._htorch = htorch
        self._htcore = htcore
        self.lazy = lazy
        self.torch_device = torch.device("hpu")
        self._metric = None
        try:
            from habana_frameworks.torch.hpu.metrics import metric_global

            self._metric = metric_global("graph_compilation")
        except (ImportError, AttributeError, RuntimeError) as e:  # unavailable, not fatal
            logger.warning("HPU graph-compilation metric unavailable (%s): recompiles after "
                           "warmup cannot be counted", e)

    def mark_step(self) -> None:
        if self.lazy:
            self._htcore.mark_step()

    def wrap_graph(self, module: Callable[..., Any], name: str,
                   capturable: bool = True) -> Callable[..., Any]:
        """``module`` as an HPU graph; as it is when ``capturable`` is False (a forward
        with point-to-point sends inside, which runs in plain lazy mode)."""
        if not self.lazy or not capturable:
            return module  # HPU graphs are a lazy-mode feature
        # disable_tensor_cache: inputs change every step; vllm-gaudi uses the same setting.
        return self._htorch.hpu.wrap_in_hpu_graph(module, disable_tensor_cache=True)

    def note_graph(self, name: str, *args: Any) -> None:
        """The bridge's metric counts real compilations; nothing to record here."""

    def num_compiles(self) -> int:
        if self._metric is None:
            return -1
        return int(dict(self._metric.stats()).get("TotalNumber", 0))

    def synchronize(self) -> None:
        self._htorch.hpu.synchronize()

    def env_info(self) -> dict[str, str]:
        info = {"hpu_lazy_mode": str(int(self.lazy))}
        try:
            info["hpu_device"] = str(self._htorch.hpu.get_device_name())
        except (AttributeError, RuntimeError) as e:
            logger.debug("no HPU device name: %s", e)
        return info


def fused_sdpa() -> Callable[..., torch.Tensor] | None:
    """Habana's fused SDPA kernel when the bridge has it, else None (torch SDPA is used)."""
    try:
        from habana_frameworks.torch.hpex.kernels import FusedSDPA
    except ImportError:
        return None
    return FusedSDPA.apply


def make_device(lazy: bool | None = None) -> EmulatedDevice | HabanaDevice:
    lazy = lazy_mode_requested() if lazy is None else lazy
    return EmulatedDevice(lazy) if emulation_requested() else HabanaDevice(lazy)
