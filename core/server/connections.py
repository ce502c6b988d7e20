"""A deadline for a request's headers, which uvicorn does not have.

uvicorn closes an idle keep-alive connection after ``--timeout-keep-alive``, but a new
connection that sends nothing, or sends its headers a byte at a time (each byte cancels
the keep-alive timer), is held open for ever: a few hundred such clients exhaust the
server's file descriptors while sending almost nothing (slowloris). The ASGI app cannot
help: it first hears of a request once its headers are complete. So the deadline lives in
the HTTP protocol: a connection whose request headers are not all in ``seconds`` after it
opened, or after its previous response, gets HTTP 408 and is closed. Once the headers are
in, ``--request-body-timeout`` (core/server/limits.py) bounds the body.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)

_REPLY = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
          b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol class with the header deadline (pass it as ``http=``)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    message = (f"the request headers did not arrive within {seconds:g} s "
               f"(--header-timeout)\n").encode()

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a whole request line and headers
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE:  # waiting for the next request's headers
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                return
            logger.info("closing a connection whose request headers did not arrive within "
                        "%g s", seconds)
            self.transport.write(_REPLY % (len(message), message))
            self.transport.close()

    return HeaderTimeoutProtocol
