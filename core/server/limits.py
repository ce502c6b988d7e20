"""What one client may cost the server: the API key, the body's size and read deadline, the
per-request deadline, and caps on ``n``, ``temperature`` and the default ``max_tokens``.

docs/server.md ("Limits") lists each flag, its default and the status it answers with.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from cadence.server.errors import error_response
from cadence.server.protocol import RequestError

T = TypeVar("T")

# OpenAI's documented upper bound; --allow-any-temperature lifts it for another API's scale.
MAX_OPENAI_TEMPERATURE = 2.0


@dataclass(slots=True, frozen=True)
class ServerLimits:
    """Per-server limits on requests; ``None`` turns a time limit or the token cap off.

    ``default_max_tokens`` caps the ``max_tokens`` of a request that leaves it out (chat) or
    sends null: such a request gets the rest of the context, at most this many tokens.
    """

    default_max_tokens: int | None = 4096
    max_n: int = 16
    allow_any_temperature: bool = False
    request_body_timeout: float | None = 30.0
    request_timeout: float | None = None

    def __post_init__(self) -> None:
        for name in ("default_max_tokens", "max_n"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("request_body_timeout", "request_timeout"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a number of seconds > 0 or None (off), "
                                 f"got {value!r}")

    def check(self, req: Any) -> None:
        """Raise ``RequestError`` (400) when ``n``, ``best_of`` or ``temperature`` of an
        OpenAI request body is beyond this server's limits."""
        for name in ("n", "best_of"):
            value = getattr(req, name, None)
            if value is not None and value > self.max_n:
                raise RequestError(f"{name} must be <= {self.max_n} on this server (--max-n), "
                                   f"got {value}", name)
        t = req.temperature
        if t is not None and t > MAX_OPENAI_TEMPERATURE and not self.allow_any_temperature:
            raise RequestError(f"temperature must be in [0, {MAX_OPENAI_TEMPERATURE:g}], got "
                               f"{t} (the server accepts more only when started with "
                               "--allow-any-temperature)", "temperature")

    def max_tokens_for(self, room: int) -> int:
        """The ``max_tokens`` of a request that gives none, with ``room`` tokens of context
        left after its prompt."""
        return room if self.default_max_tokens is None else min(room, self.default_max_tokens)


def check_api_key(api_key: str) -> None:
    """Raise ValueError unless ``api_key`` can travel in an ``Authorization`` header."""
    if not api_key or not api_key.isascii() or not api_key.isprintable() or " " in api_key:
        raise ValueError("api_key (--api-key or CADENCE_API_KEY) must be a non-empty string "
                         "of printable ASCII characters without spaces")


class ApiKeyAuth:
    """ASGI middleware: every HTTP request outside ``open_paths`` must carry
    ``Authorization: Bearer <api_key>`` (OpenAI's clients) or ``x-api-key: <api_key>``
    (Anthropic's); any other gets 401 with ``WWW-Authenticate``.

    It runs before the body is read, so a client without the key costs neither a body
    buffer nor a wait for its body.
    """

    def __init__(self, app: Any, api_key: str,
                 open_paths: frozenset[str] = frozenset({"/health"})) -> None:
        check_api_key(api_key)
        self.app = app
        self.open_paths = open_paths
        # Digests have one length whatever the key's, so compare_digest cannot leak it.
        self._digest = hashlib.sha256(api_key.encode("ascii")).digest()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scheme, _, bearer = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer":
            token, where = bearer, "Authorization: Bearer <key>"
        else:
            token, where = headers.get(b"x-api-key"), "x-api-key: <key>"
        if token is None:
            message = ("this server needs an API key: send it as 'Authorization: Bearer "
                       "<key>' or 'x-api-key: <key>'")
        elif not hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest):
            message = f"the API key in '{where}' is not valid"
        else:
            await self.app(scope, receive, send)
            return
        response = error_response(401, message, code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"}, path=scope["path"])
        await response(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body must hold at most ``max_bytes`` (else 413), declared
    or not, and arrive whole within ``timeout`` seconds of the headers (else 408).

    The body is read here and replayed to the app: a chunked upload without Content-Length
    cannot slip past, FastAPI never buffers an oversized body, and a client that stalls or
    trickles its body is cut off before anything is queued.
    """

    def __init__(self, app: Any, max_bytes: int, timeout: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send, int(declared))
            return
        loop = asyncio.get_running_loop()
        end = None if self.timeout is None else loop.time() + self.timeout
        chunks, size = [], 0
        while True:
            try:
                message = await (receive() if end is None else
                                 asyncio.wait_for(receive(), max(0.0, end - loop.time())))
            except asyncio.TimeoutError:
                await self._too_slow(scope, receive, send, size)
                return
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send, size)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # later reads wait for the disconnect, as usual

        await self.app(scope, replay, send)

    async def _too_large(self, scope: dict, receive: Any, send: Any, size: int) -> None:
        response = error_response(
            413, f"the request body has {size}+ bytes; this server accepts at most "
                 f"{self.max_bytes} (--max-request-bytes)", path=scope["path"])
        await response(scope, receive, send)

    async def _too_slow(self, scope: dict, receive: Any, send: Any, size: int) -> None:
        # The rest of the body may still come: the connection cannot carry another request.
        response = error_response(
            408, f"the request body did not arrive within {self.timeout:g} s "
                 f"(--request-body-timeout); {size} bytes came", code="request_body_timeout",
            headers={"Connection": "close"}, path=scope["path"])
        await response(scope, receive, send)


class DeadlineExceeded(RuntimeError):
    """A request ran past ``--request-timeout`` and was aborted in the engine (HTTP 504)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request did not finish within {seconds:g} s "
                         "(--request-timeout) and was aborted; ask for fewer tokens "
                         "(max_tokens, n) or retry later")


@dataclass(slots=True, frozen=True)
class Deadline:
    """When a request must be done, on the event loop's clock; ``at=None``: never."""

    at: float | None
    seconds: float | None

    @classmethod
    def start(cls, seconds: float | None) -> Deadline:
        """A deadline ``seconds`` from now (``None``: none)."""
        if seconds is None:
            return cls(None, None)
        return cls(asyncio.get_running_loop().time() + seconds, seconds)

    def _left(self) -> float:
        assert self.at is not None
        return max(0.0, self.at - asyncio.get_running_loop().time())

    async def run(self, work: Awaitable[T]) -> T:
        """Await ``work``; past the deadline cancel it (for engine work, that aborts its
        requests) and raise ``DeadlineExceeded``."""
        if self.at is None:
            return await work
        try:
            return await asyncio.wait_for(work, self._left())
        except asyncio.TimeoutError:
            raise DeadlineExceeded(self.seconds) from None

    async def stream(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Yield ``events`` until the deadline; then close them (which aborts their requests)
        and raise ``DeadlineExceeded``."""
        async with contextlib.aclosing(events):
            it = events.__aiter__()
            while True:
                try:
                    event = await self.run(it.__anext__())
                except StopAsyncIteration:
                    return
                yield event


def check_request_count(engine: Any, count: int, field: str) -> None:
    """Refuse (400) a body that needs more requests at once than the server takes: a 429
    would ask the client to retry what can never fit."""
    limit = getattr(engine, "max_pending_requests", None)
    if limit is not None and count > limit:
        raise RequestError(f"{field} needs {count} requests at once; this server takes at most "
                           f"{limit} (--max-pending-requests)", field)
