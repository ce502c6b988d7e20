"""The caller's side of ``AsyncLLM``: one request's outputs as an async iterator, and how
the engine thread hands them over (one ``call_soon_threadsafe`` per caller loop per step).
No torch here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cadence.outputs import RequestOutput

if TYPE_CHECKING:
    from cadence.async_engine import AsyncLLM


class RequestFailedError(RuntimeError):
    """The engine could not serve this request (a step failed on it, or its worker was
    lost); the others are unaffected. ``output`` is its final output (finish_reason
    ``"error"``), with the tokens it had produced."""

    def __init__(self, output: RequestOutput) -> None:
        super().__init__(output.error or "the request failed")
        self.output = output


@dataclass(slots=True)
class Channel:
    """Where one submission's outputs go: its caller's loop and queue, under the id the
    caller chose and the engine-side id (the caller's, or with a submission number when
    the engine may still hold an earlier request under it)."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    user_id: str
    engine_id: str


class RequestStream:
    """The outputs of one request, as an async iterator (from ``AsyncLLM.add_request``).

    Iterate it once. Stopping early (``break``, cancellation, ``abort()``) aborts the
    request in the engine, so its KV blocks are freed; after the final output it is a no-op.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, channel: Channel) -> None:
        self.request_id = request_id
        self._engine = engine
        self._channel = channel
        self._outputs = channel.outputs
        self._done = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not self._done:
                item = await self._outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if finished and item.error is not None:
                    raise RequestFailedError(item)
                yield item
                if finished:
                    break
        finally:
            self._close(finished)

    def abort(self) -> None:
        """Abort the request if it is still running, without waiting for its final output."""
        self._close(False)

    def _close(self, finished: bool) -> None:
        if not self._done:
            self._done = True
            self._engine._release(self._channel, finished)


def deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for stream, out in items:
        stream.put_nowait(out)


def call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # that caller's event loop is closed: nobody is listening
        pass


async def add_all(engine: Any, requests: list[tuple]) -> list[RequestStream]:
    """``engine.add_request(*args)`` for every entry, all queued at once, or none: if one is
    refused, those already queued are aborted and the first error (in entry order) is
    raised.

    NOTE the engine thread applies queued commands between steps: awaited one after the
    other, a body of N prompts would enter the engine one per step (a 2048-input embedding
    body, 2048 steps). Queued together, they are applied before the same step.
    """
    tasks = [asyncio.ensure_future(engine.add_request(*args)) for args in requests]
    try:
        results = await asyncio.gather(*tasks, return_exceptions=True)
    except BaseException:
        # Cancelled (a deadline, a client gone): by now every entry is done, and those
        # already queued would keep their place in the engine, and their slot of
        # max_pending_requests, with nobody left to read or abort them.
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().abort()
        raise
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for r in results:
            if isinstance(r, RequestStream):
                r.abort()
        raise errors[0]
    return list(results)


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream (``merge`` aborts them all if this is cancelled)."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merge(streams):
        if out.finished:
            finals[i] = out
    assert all(f is not None for f in finals)
    return finals


async def merge(streams: list[RequestStream]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams' outputs in arrival order, tagged with the stream index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    merged: asyncio.Queue = asyncio.Queue()
    _END = object()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await merged.put((i, out))
            await merged.put((i, _END))
        except BaseException as e:
            await merged.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, item = await merged.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()
