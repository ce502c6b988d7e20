"""The asyncio front end: ``AsyncLLM.generate(...)`` streams ``RequestOutput``s.

One background thread owns the ``LLMEngine`` and runs its step loop; the event loop never
touches the engine. Requests and aborts reach the thread through a command queue and are
applied between steps; outputs come back to per-request ``asyncio.Queue``s with one
``call_soon_threadsafe`` per step. The engine's own overlap (finalize of step N while the
device computes step N+1) is unchanged: this layer only moves its outputs across threads.
The thread's side is core/engine_thread.py.

NOTE on the GIL: the step loop's host work is short and the CPU backend's default strategy
computes in a worker process (the thread waits on a pipe, without the GIL), so HTTP handling
and the engine share the interpreter without starving each other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from cadence.async_stream import (
    Channel,
    RequestFailedError,
    RequestStream,
)
from cadence.engine import LLMEngine
from cadence.engine_args import EngineArgs
from cadence.engine_thread import (
    _STOP,
    EngineDeadError,
    EngineOverloadedError,
    EngineThread,
    _Abort,
    _Add,
)
from cadence.generation_defaults import default_sampling_params
from cadence.metrics import EngineStats
from cadence.output_state import OutputKind
from cadence.pooling import PoolingParams
from cadence.request_front import RequestFront, request_ids
from cadence.sampling_params import SamplingParams, resolve_output_kind

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError", "RequestFailedError",
           "RequestStream"]


class AsyncLLM(EngineThread, RequestFront):
    """Serve many concurrent streams from one engine.

    ``generate`` is an async generator: it yields one ``RequestOutput`` each time the
    request progressed (new text in ``DELTA`` mode, everything so far in ``CUMULATIVE``
    mode, once at the end with ``FINAL_ONLY``) and ends after the output with
    ``finished=True``. Leaving the loop early (a client disconnect, ``break``, task
    cancellation) aborts the request, so its KV blocks are freed.

    Bad input raises ``ValueError`` from ``generate`` before anything is queued;
    ``max_pending_requests`` bounds the requests in flight (beyond it:
    ``EngineOverloadedError``).
    """

    #: Seconds the idle loop sleeps between health checks of the backend: a worker that dies
    #: while nothing runs is restarted within this long.
    health_check_interval_s = 1.0

    def __init__(self, engine: LLMEngine, max_pending_requests: int | None = None) -> None:
        if max_pending_requests is not None and max_pending_requests < 1:
            raise ValueError(f"max_pending_requests must be None or >= 1, "
                             f"got {max_pending_requests}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.scheduler_config.max_model_len
        self.generation_defaults = engine.config.model_config.generation_defaults
        self.eos_token_ids = engine.eos_token_ids
        self.max_pending_requests = max_pending_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Keyed by the engine-side id: the caller's id, unless the engine may still hold an
        # earlier request under it (aborted or abandoned, its final output not yet seen);
        # then the id gets a submission number, so that request's abort or late output
        # never reaches the new stream.
        self._streams: dict[str, Channel] = {}
        self._by_user_id: dict[str, str] = {}
        self._in_engine: set[str] = set()
        self._lock = threading.Lock()  # guards _streams between the loop and the engine thread
        self._ids = itertools.count()
        self._submissions = itertools.count()
        self._error: BaseException | None = None
        self._closed = False  # set under _lock once the loop stops taking commands
        self._stats = engine.stats.snapshot()
        self._thread = threading.Thread(target=self._run, name="cadence-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, extra: dict | None = None,
                         max_pending_requests: int | None = None) -> AsyncLLM:
        return cls(LLMEngine.from_engine_args(args, extra), max_pending_requests)

    # ---- the public API ---------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def check_health(self) -> str | None:
        """None when the engine can serve; otherwise why not (for ``/health``).

        Asks the backend directly, so a worker that died is reported at once, even while
        the engine thread is idle or busy restarting it.
        """
        if not self.is_running:
            return f"the engine is not running ({self._error!r})" if self._error \
                else "the engine is not running"
        if self.engine.guard.restart_pending:
            return "the engine is restarting its worker"
        try:
            self.engine.backend.check_health()
        except Exception as e:
            return str(e)
        return None

    @property
    def num_pending_requests(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's stats, taken after the latest step (never torn)."""
        return self._stats

    def replica_stats(self) -> list[EngineStats]:
        """``[stats()]``: one engine is one replica (core/data_parallel/ serves several)."""
        return [self._stats]

    def has_request(self, request_id: str) -> bool:
        """Whether a request under this id is in flight (its stream not yet closed)."""
        with self._lock:
            return request_id in self._by_user_id

    async def add_request(self, prompt: str | Sequence[int] | dict,
                          params: SamplingParams | PoolingParams | None = None,
                          request_id: str | None = None, priority: int = 0,
                          output_kind: OutputKind | None = None,
                          lora_request: Any = None) -> RequestStream:
        """Validate and queue one request; iterate the returned stream for its outputs.
        ``lora_request``: a ``cadence.lora.LoRARequest`` to run it with an adapter.
        ``output_kind`` None: the params' ``output_kind``, else ``CUMULATIVE`` (vLLM's
        default: each output holds everything so far; ``DELTA`` streams the new part).

        Raises ValueError (bad input), EngineOverloadedError or EngineDeadError before
        anything is queued, so a server can answer 400/429/503 before it starts streaming.
        """
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if params is None:
            params = default_sampling_params(self.engine.config.model_config)
        output_kind = resolve_output_kind(output_kind, params, OutputKind.CUMULATIVE)
        queue_ = await self._add(rid, prompt, params, priority, output_kind, lora_request)
        return RequestStream(self, rid, queue_)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort a request, or each of several ids (vLLM takes both); its stream ends with a
        final output (finish_reason 'abort'). An id not in flight is ignored."""
        for rid in request_ids(request_id):
            with self._lock:
                engine_id = self._by_user_id.get(rid)
            if engine_id is not None:
                self._commands.put(_Abort(engine_id))

    async def shutdown(self) -> None:
        """Stop the loop (pending requests end with ``EngineDeadError``) and the backend."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ---- submission -------------------------------------------------------------------
    async def _add(self, rid: str, prompt: Any, params: SamplingParams | PoolingParams,
                   priority: int, output_kind: OutputKind, lora_request: Any = None
                   ) -> Channel:
        if not isinstance(rid, str):
            raise ValueError(f"request_id must be a string, got {type(rid).__name__}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        channel = Channel(asyncio.get_running_loop(), asyncio.Queue(), rid, rid)
        with self._lock:
            if self._closed:
                raise EngineDeadError(f"the engine is not running ({self._error!r})")
            if rid in self._by_user_id:
                raise ValueError(f"request_id {rid!r} is already in use")
            limit = self.max_pending_requests
            if limit is not None and len(self._streams) >= limit:
                raise EngineOverloadedError(
                    f"{len(self._streams)} requests are in flight (max_pending_requests="
                    f"{limit}); retry later")
            if rid in self._in_engine:
                channel.engine_id = f"{rid}@{next(self._submissions)}"
            self._in_engine.add(channel.engine_id)
            self._streams[channel.engine_id] = channel
            self._by_user_id[rid] = channel.engine_id
            self._commands.put(_Add(channel.engine_id, prompt, params, priority, output_kind,
                                    done, lora_request))
        try:
            # Validation happens in the engine thread, between steps: the engine is not
            # thread-safe, and this way a ValueError reaches the caller, not the loop.
            await asyncio.wrap_future(done)
        except BaseException as e:
            self._forget(channel)
            if isinstance(e, Exception):  # refused by the engine: it holds nothing under it
                with self._lock:
                    self._in_engine.discard(channel.engine_id)
            else:
                # Cancelled while the engine thread may already have queued it: abort it
                # (commands are applied in order, so the abort follows the add).
                self._commands.put(_Abort(channel.engine_id))
            raise
        return channel

    def _forget(self, channel: Channel) -> None:
        with self._lock:
            self._streams.pop(channel.engine_id, None)
            if self._by_user_id.get(channel.user_id) == channel.engine_id:
                del self._by_user_id[channel.user_id]

    def _release(self, channel: Channel, finished: bool) -> None:
        self._forget(channel)
        if not finished and self.is_running:
            self._commands.put(_Abort(channel.engine_id))
