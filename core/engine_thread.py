"""``AsyncLLM``'s engine thread: the one thread that owns the ``LLMEngine``. It applies the
commands the event loop queued (adds, aborts, stop) between steps, runs the steps, and hands
each step's outputs to the streams' event loops with one ``call_soon_threadsafe`` per loop.
When it fails, every stream and every queued submission learns why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
from dataclasses import dataclass, replace
from typing import Any

from cadence.async_stream import call_soon, deliver
from cadence.output_state import OutputKind
from cadence.outputs import RequestOutput
from cadence.pooling import PoolingParams
from cadence.sampling_params import SamplingParams
from cadence.structured_output.manager import BLOCK_S

# AsyncLLM's logger: the engine loop's failures are the front end's to whoever filters.
logger = logging.getLogger("cadence.async_engine")


class EngineOverloadedError(RuntimeError):
    """Too many requests are in flight; the caller should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; no request can be served (HTTP 503)."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams | PoolingParams
    priority: int
    output_kind: OutputKind
    done: concurrent.futures.Future
    lora_request: Any = None


@dataclass(slots=True)
class _Abort:
    request_id: str


_STOP = object()


class EngineThread:
    """``AsyncLLM``'s engine-thread side (a mixin: it uses the front end's engine, command
    queue, streams and lock)."""

    def _run(self) -> None:
        engine = self.engine
        stalled = False
        try:
            while True:
                # Block when idle, and when the last step could run nothing (requests that
                # wait for blocks only a command can free): only a command changes that.
                # Otherwise take what arrived during the last step.
                cmds = []
                # A worker lost in the last step: its requests' errors went out with that
                # step's outputs; restart it before anything else.
                engine.repair()
                if stalled or not engine.has_unfinished_requests():
                    # A stall while grammars compile ends when one is ready: look again soon.
                    wait_s = BLOCK_S if engine.structured.num_waiting else \
                        self.health_check_interval_s
                    try:
                        cmds.append(self._commands.get(timeout=wait_s))
                    except queue.Empty:
                        self._dispatch(engine.check_health())
                        stalled = False
                        continue
                while True:
                    try:
                        cmds.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if any(c is _STOP for c in cmds):
                    error = EngineDeadError("the engine was shut down")
                    for cmd in cmds:
                        if isinstance(cmd, _Add) and not cmd.done.done():
                            cmd.done.set_exception(error)
                    self._fail_all(error)
                    return
                for cmd in cmds:
                    self._apply(cmd)
                if engine.has_unfinished_requests():
                    steps = engine.stats.num_steps
                    outputs = engine.step()
                    stalled = engine.stats.num_steps == steps and not outputs
                    # Snapshot first: a caller woken by its final output sees stats with it.
                    self._stats = engine.stats.snapshot()
                    self._dispatch(outputs)
        except BaseException as e:  # a bug or a device failure: every stream must learn it
            logger.exception("engine loop failed")
            self._error = e
            # The gauges of a dead engine: nothing runs, waits or holds the cache (the last
            # snapshot would report its failed requests as running forever). Set before the
            # streams learn of the failure, so none of them reads the old ones after it.
            self._stats = replace(self._stats, num_running=0, num_waiting=0,
                                  kv_cache_usage=0.0, running_loras=(), waiting_loras=())
            self._fail_all(EngineDeadError(f"the engine loop failed: {e!r}"))
        finally:
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

    def _apply(self, cmd: Any) -> None:
        if isinstance(cmd, _Abort):
            self.engine.abort_request(cmd.request_id)
            return
        if not cmd.done.set_running_or_notify_cancel():
            return  # the caller was cancelled before its request got here: never add it
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.priority,
                                    cmd.output_kind, cmd.lora_request)
        except Exception as e:  # ValueError for bad input; anything else is reported too
            cmd.done.set_exception(e)
        else:
            cmd.done.set_result(None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outputs:
                if out.finished:
                    self._in_engine.discard(out.request_id)
                target = self._streams.get(out.request_id)
                if target is None:  # the caller left; its abort is queued
                    continue
                if target.engine_id != target.user_id:
                    # A copy: the post-sample hook may hold the engine's output.
                    out = replace(out, request_id=target.user_id)
                by_loop.setdefault(target.loop, []).append((target.outputs, out))
        for loop, items in by_loop.items():
            call_soon(loop, deliver, items)

    def _fail_all(self, error: BaseException) -> None:
        """End every stream and every queued submission with ``error``; take no more."""
        with self._lock:
            self._closed = True
            targets = list(self._streams.values())
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, _Add) and not cmd.done.done():
                    cmd.done.set_exception(error)
        for channel in targets:
            call_soon(channel.loop, channel.outputs.put_nowait, error)
