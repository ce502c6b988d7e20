"""Step strategies chosen by configuration. No torch here.

The default loop lives in ``cadence.engine`` (schedule -> execute -> commit, with finalize of
the previous step inside ``execute``). ``async_scheduling=True`` swaps in
``AsyncSchedulingLoop`` (loop.py) and ``AsyncScheduler`` (async_scheduler.py): step N+1 is
planned and submitted while step N computes, with placeholders for the tokens step N has not
returned yet (docs/async_scheduling.md). ``pipeline_parallel_size`` > 1 swaps in
``PipelineLoop`` and ``PipelineScheduler`` (pipeline.py): one micro-batch of other requests
in flight per stage (docs/distributed.md); it plans ahead without placeholders, and is what
``async_scheduling`` means under pipeline parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cadence.block_manager import BlockManager
from cadence.config import EngineConfig
from cadence.lora.admission import LoRAAdmission
from cadence.request import Request
from cadence.scheduler import Scheduler
from cadence.scheduling.async_scheduler import AsyncScheduler
from cadence.scheduling.loop import AsyncSchedulingLoop
from cadence.scheduling.pipeline import PipelineLoop, PipelineScheduler
from cadence.spec_decode import Speculator

if TYPE_CHECKING:
    from cadence.engine import LLMEngine

__all__ = ["AsyncScheduler", "AsyncSchedulingLoop", "PipelineLoop", "PipelineScheduler",
           "check_backend_supports", "check_quantization_support", "check_speculation_support",
           "make_scheduler",
           "make_step_loop", "require_backend_flag"]


def make_scheduler(config: EngineConfig, block_manager: BlockManager,
                   settle: Callable[[Request], None]) -> Scheduler:
    """The scheduler the configured step strategy plans with."""
    sc = config.scheduler_config
    # At most max_loras adapters in the running batch (cadence/lora).
    admission = None if config.lora_config is None else \
        LoRAAdmission(config.lora_config.max_loras)
    stages = config.parallel_config.pipeline_parallel_size
    if stages > 1:
        return PipelineScheduler(sc, block_manager, settle=settle, num_stages=stages,
                                 admission=admission)
    if config.plans_with_placeholders:
        return AsyncScheduler(sc, block_manager, settle=settle, admission=admission)
    spec = config.speculative_config
    speculator = None if spec is None else Speculator(spec, sc.max_model_len)
    return Scheduler(sc, block_manager, settle=settle, admission=admission,
                     speculator=speculator)


def make_step_loop(engine: LLMEngine) -> AsyncSchedulingLoop | PipelineLoop | None:
    """The configured step strategy; None for the engine's own loop."""
    config = engine.config
    stages = config.parallel_config.pipeline_parallel_size
    if stages > 1:
        return PipelineLoop(engine, stages)
    return AsyncSchedulingLoop(engine) if config.plans_with_placeholders else None


def _backends_where(registry: Any, supports: Callable[[type], bool]) -> list[str]:
    """The installed backends whose class ``supports`` accepts, by name: what a refusal
    offers instead."""
    return sorted(name for name, info in registry.backends.items() if supports(info.cls))


def require_backend_flag(backend_cls: type, registry: Any, flag: str, feature: str,
                         remedy: str) -> None:
    """Refuse ``feature`` (with its verb: "LoRA adapters are") on a backend that does not
    declare ``flag``, naming the installed backends that do and ``remedy``."""
    if getattr(backend_cls, flag, False):
        return
    able = _backends_where(registry, lambda cls: getattr(cls, flag, False))
    raise ValueError(f"{feature} not supported by backend {backend_cls.name!r}; backends "
                     f"that support it: {', '.join(able) or '(none)'} ({remedy})")


def check_backend_supports(backend_cls: type, registry: Any) -> None:
    """Refuse async scheduling on a backend that does not implement the placeholder protocol
    (``Backend.supports_async_scheduling``), naming those that do."""
    require_backend_flag(backend_cls, registry, "supports_async_scheduling",
                         "async_scheduling is", "or turn async_scheduling off")


def check_speculation_support(backend_cls: type, registry: Any, config: EngineConfig) -> None:
    """Refuse speculative decoding with what it does not run with: async scheduling and
    pipeline parallel (the schedulers of those plan without drafts), and a backend that does
    not sample the rows of a sequence's drafts (``Backend.supports_speculative``), naming
    those that do."""
    if config.async_scheduling:
        raise ValueError("speculative_config cannot be combined with async_scheduling: each "
                         "step is planned on the tokens the step before it kept (turn one off)")
    stages = config.parallel_config.pipeline_parallel_size
    if stages > 1:
        raise ValueError(f"speculative_config runs with pipeline_parallel_size=1 only, got "
                         f"{stages}")
    require_backend_flag(backend_cls, registry, "supports_speculative", "speculative decoding is",
                         "or start without speculative_config")


def check_quantization_support(backend_cls: type, registry: Any, method: str | None,
                               model: str | None = None) -> None:
    """Refuse quantization ``method`` on a backend that does not run it
    (``Backend.supports_quantization``), naming those that do. A checkpoint that is itself
    quantized with it (``model``'s quantization_config) cannot drop it: the message says
    so."""
    if method is None or method in backend_cls.supports_quantization:
        return
    able = _backends_where(registry,
                           lambda cls: method in getattr(cls, "supports_quantization", ()))
    from cadence.quantization.checkpoint import PACKED_METHODS, checkpoint_quantization

    if model is not None and method in PACKED_METHODS and checkpoint_quantization(model):
        raise ValueError(f"model {model!r} is quantized with {method} (quantization_config "
                         f"in its config.json), which backend {backend_cls.name!r} does not "
                         f"run; backends that run it: {', '.join(able) or '(none)'}")
    raise ValueError(f"quantization {method!r} is not supported by backend "
                     f"{backend_cls.name!r}; backends that run it: {', '.join(able) or '(none)'} "
                     "(or drop --quantization)")


def check_backend_runs(backend_cls: type, registry: Any, config: EngineConfig) -> None:
    """Refuse, before anything loads, what ``config`` asks of a backend that does not run it
    (async scheduling, LoRA, speculative decoding, quantization), naming those that do."""
    if config.plans_with_placeholders:
        check_backend_supports(backend_cls, registry)
    if config.lora_config is not None:
        require_backend_flag(backend_cls, registry, "supports_lora", "LoRA adapters are",
                             "or start without enable_lora")
    if config.speculative_config is not None:
        check_speculation_support(backend_cls, registry, config)
    check_quantization_support(backend_cls, registry, config.model_config.quantization,
                               config.model_config.model)
