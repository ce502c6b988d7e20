"""Step strategies chosen by configuration. No torch here.

The default loop lives in ``cadence.engine`` (schedule -> execute -> commit, with finalize of
the previous step inside ``execute``). ``async_scheduling=True`` swaps in
``AsyncSchedulingLoop`` (loop.py) and ``AsyncScheduler`` (async_scheduler.py): step N+1 is
planned and submitted while step N computes, with placeholders for the tokens step N has not
returned yet (docs/async_scheduling.md).
"""

from __future__ import annotations

from typing import Any

from cadence.scheduler import Scheduler
from cadence.scheduling.async_scheduler import AsyncScheduler
from cadence.scheduling.loop import AsyncSchedulingLoop

__all__ = ["AsyncScheduler", "AsyncSchedulingLoop", "check_backend_supports", "scheduler_class"]


def scheduler_class(async_scheduling: bool) -> type[Scheduler]:
    return AsyncScheduler if async_scheduling else Scheduler


def check_backend_supports(backend_cls: type, registry: Any) -> None:
    """Refuse async scheduling on a backend that does not implement the placeholder protocol
    (``Backend.supports_async_scheduling``), naming those that do."""
    if getattr(backend_cls, "supports_async_scheduling", False):
        return
    able = sorted(name for name, info in registry.backends.items()
                  if getattr(info.cls, "supports_async_scheduling", False))
    raise ValueError(
        f"async_scheduling is not supported by backend {backend_cls.name!r}; backends that "
        f"support it: {', '.join(able) or '(none)'} (or turn async_scheduling off)")
