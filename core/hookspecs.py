"""The pluggy hook specifications of cadence: the whole plugin surface in one module.

Implement any of these in a module registered under the ``cadence.backends`` entry-point
group, marked with ``cadence.hookimpl``. pluggy is used at start-up and in the post-sample
hook only; the per-step calls go straight to the selected ``Backend`` object.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from cadence.backend import Backend
    from cadence.outputs import RequestOutput

PROJECT = "cadence"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def cadence_register_backends(register: Callable[[type[Backend]], None]) -> None:
    """Register backend classes by calling ``register(BackendClass)``.

    Called once when the plugin manager loads plugins (in every process that builds an
    engine, so registering must be idempotent and cheap). Do not import the device library
    here: ``probe()`` decides availability later, and only the selected backend is built.
    """


@hookspec
def cadence_add_cli_options(parser: argparse.ArgumentParser) -> None:
    """Add backend-specific flags to the ``engine`` sub-commands that build an engine.

    Called once per parser. Prefix flags with the backend name to avoid clashes (for
    example ``--cuda-graph-max-bs``); read them back in ``cadence_configure``.
    """


@hookspec
def cadence_configure(config: dict[str, Any]) -> None:
    """Adjust the engine arguments (a mutable dict of ``EngineArgs`` fields plus parsed CLI
    flags) before the frozen ``EngineConfig`` is built. Called once per engine, in plugin
    registration order. Put backend knobs into ``config["backend_options"]`` (a dict).
    """


@hookspec
def cadence_post_sample(outputs: list[RequestOutput]) -> None:
    """Observe every output the engine emits (host data only), a batch at a time.

    Mostly called inside finalize, i.e. inside the backend's post-sample callback while the
    device runs the next step, so keep it short; also for the single output a transition
    emits (a stop found when a request is preempted, an abort, a failure). Not called at
    all when no plugin implements it. Never mutate the outputs. An embedding request's one
    output is an ``EmbeddingRequestOutput`` (``outputs.embedding``, no samples).
    """


@hookspec
def cadence_env_info() -> dict[str, str]:
    """Return facts for bug reports and benchmark JSON (versions, device names)."""


@hookspec
def cadence_shutdown() -> None:
    """Release global resources; called once when an engine shuts down."""
