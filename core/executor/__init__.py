"""Executors: what runs a backend's ranks on behalf of the single-process engine core.

- ``uniproc``: the backend in the engine's own process (one rank; the path every backend
  had before tensor parallel). No wrapper: the engine talks to the backend directly.
- ``mp``: one worker process per rank on this host (multiproc.py). The engine sends each
  step's ``ModelInput`` to every rank, runs the previous step's finalize while they compute,
  and reads back one rank's samples only (rank 0's; the last stage's under pipeline
  parallel, with one micro-batch in flight per stage).
- ``ray``: each rank a Ray actor, on this host or across a cluster (ray_executor.py).

``mp`` and ``ray`` share the step protocol and its failure rules (``RankGroup``,
rank_group.py) and differ in the transport only.

An executor is a ``Backend`` to the engine (same lifecycle, ``execute``/``submit``/
``collect``, ``check_health``, ``restart``), so the step loops, the fault guard and the
server's /health work unchanged whichever runs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from cadence.executor.checks import check_pipeline_parallel_model, check_tensor_parallel_model

if TYPE_CHECKING:
    from cadence.backend import Backend
    from cadence.config import EngineConfig

__all__ = ["check_pipeline_parallel_model", "check_tensor_parallel_model", "create_executor"]

logger = logging.getLogger(__name__)


def create_executor(backend_cls: type[Backend], config: EngineConfig) -> Backend:
    """The backend, or an executor running its ranks, as ``config.parallel_config`` asks.
    ValueError (before any process starts) for a split the backend or model cannot run."""
    parallel = config.parallel_config
    executor = parallel.executor
    backend_cls.check_parallel_config(config)
    if parallel.tensor_parallel_size > 1:
        check_tensor_parallel_model(config.model_config.model, parallel.tensor_parallel_size,
                                    parallel.enable_expert_parallel,
                                    config.model_config.quantization)
    elif parallel.enable_expert_parallel:
        # Accepted (a deployment may pass it whatever the size, as vLLM's does), but said.
        logger.warning("--enable-expert-parallel has no effect with one tensor-parallel "
                       "rank: it holds every expert")
    if parallel.pipeline_parallel_size > 1:
        check_pipeline_parallel_model(config.model_config.model,
                                      parallel.pipeline_parallel_size)
    if executor == "uniproc":
        return backend_cls(config)
    if executor == "ray":
        from cadence.executor.ray_executor import RayExecutor

        return RayExecutor(backend_cls, config)
    from cadence.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(backend_cls, config)
