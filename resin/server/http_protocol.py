"""Connection limits uvicorn lacks: request-head size and time limits, plus the uvicorn options.

uvicorn's ``httptools`` protocol (its default HTTP implementation when httptools is installed,
as with ``resin[serve]``) accepts a request line or header of any size — llhttp buffers a 64 MB
header line whole — and waits forever for a request head (``timeout_keep_alive`` is only
armed after a response). :class:`LimitedHttpToolsProtocol` adds, per connection:

- ``max_header_bytes`` (``--max-header-bytes``, nginx's ``large_client_header_buffers`` total,
  32 KiB): the request line plus headers; over it → ``431`` and the connection closed. Bytes of a
  head still incomplete are counted as they arrive, so an endless header line is cut off after
  at most one read beyond the limit;
- ``timeout_header`` (``--timeout-header``, nginx's ``client_header_timeout``, 60 s): the whole
  request head must arrive within this time of the connection opening (or of its first byte,
  on a kept-alive connection) → ``408`` and closed (closed silently if nothing arrived).

:func:`uvicorn_options` maps the rest of :class:`ServerOptions` onto uvicorn's own settings:
``timeout_keep_alive`` (``--timeout-keep-alive``, idle time between requests, nginx's 75 s),
``limit_concurrency`` (``--max-connections``; beyond it uvicorn answers ``503``; default: every
request the server admits, ``max_num_seqs + max_queued_requests``, plus 128) and
``h11_max_incomplete_event_size`` (the header limit, should ``--http h11`` ever be used).
The request *body* limits (size, time between reads) live in :mod:`resin.server.request_body`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httptools  # resin[serve] installs it: uvicorn's default HTTP implementation then
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from resin.server.context import ServerOptions

logger = logging.getLogger("resin.server")
MAX_CONNECTIONS_HEADROOM = 128  # /health, /metrics and idle keep-alive connections


class _HeadRejected(Exception):
    pass


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the request-head limits of the module doc."""

    max_header_bytes = 32 << 10
    timeout_header = 60.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._in_head = True  # between the end of one request's body and its next head
        self._head_bytes = 0  # bytes received since the head began (may include a body's)
        self._head_exact = 0  # request line + header bytes the parser reported
        self._head_timer: asyncio.TimerHandle | None = None
        self._reject: tuple[int, str] | None = None
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.timeout_header, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm_head_timer()  # a response is still being written: not our business
            return
        if self._head_bytes:
            logger.warning(
                "%s: request head not complete within %.0f s (--timeout-header); closing",
                self._peer(),
                self.timeout_header,
            )
            self._send_error(
                408, f"the request head did not arrive within {self.timeout_header:g} s"
            )
        else:
            self.transport.close()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "client"

    def _send_error(self, status: int, message: str) -> None:
        self._in_head = False
        self._cancel_head_timer()
        body = json.dumps(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": None,
                }
            }
        ).encode()
        self.transport.write(
            b"".join(
                [
                    STATUS_LINE[status],
                    b"content-type: application/json\r\n",
                    b"content-length: ",
                    str(len(body)).encode(),
                    b"\r\n",
                    b"connection: close\r\n",
                    b"\r\n",
                    body,
                ]
            )
        )
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self._in_head:
            if self._head_timer is None:
                self._arm_head_timer()
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._reject is not None:
                self._send_error(*self._reject)
            else:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
            return
        if (
            self._in_head
            and self._head_bytes > self.max_header_bytes
            and not self.transport.is_closing()
        ):
            self._too_large()

    def _too_large(self) -> None:
        logger.warning(
            "%s: request head over %d bytes (--max-header-bytes); closing",
            self._peer(),
            self.max_header_bytes,
        )
        self._send_error(
            431,
            f"the request line and headers are over this server's limit of "
            f"{self.max_header_bytes} bytes (--max-header-bytes)",
        )

    # parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_exact = 0

    def on_url(self, url: bytes) -> None:
        self._head_exact += len(url)
        self._check_exact()
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_exact += len(name) + len(value) + 4
        self._check_exact()
        super().on_header(name, value)

    def _check_exact(self) -> None:
        if self._head_exact > self.max_header_bytes:
            self._reject = (
                431,
                f"the request line and headers are over this server's limit "
                f"of {self.max_header_bytes} bytes (--max-header-bytes)",
            )
            logger.warning(
                "%s: request head over %d bytes (--max-header-bytes); closing",
                self._peer(),
                self.max_header_bytes,
            )
            raise _HeadRejected

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True
        self._head_bytes = 0


def protocol_class(options: ServerOptions) -> type:
    """A :class:`LimitedHttpToolsProtocol` with ``options``' limits."""
    return type(
        "ResinHttpProtocol",
        (LimitedHttpToolsProtocol,),
        {"max_header_bytes": options.max_header_bytes, "timeout_header": options.timeout_header},
    )


def uvicorn_options(options: ServerOptions, max_num_seqs: int) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` (besides app, host, port and log level)."""
    max_connections = options.max_connections
    if max_connections is None:
        max_connections = max_num_seqs + options.max_queued_requests + MAX_CONNECTIONS_HEADROOM
    return {
        "http": protocol_class(options),
        "timeout_keep_alive": options.timeout_keep_alive,
        "limit_concurrency": max_connections,
        "h11_max_incomplete_event_size": options.max_header_bytes,
    }
