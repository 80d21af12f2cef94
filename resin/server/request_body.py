"""Reading and decoding a request body: size and time limits, then strict JSON.

``read_body(request, limit, timeout)`` receives the body itself (not Starlette's
``request.body()``) so that it can enforce, in the API's own error format:

- the size limit (``--max-request-body-bytes``): a ``content-length`` over it is refused before
  anything is read; a chunked body is counted as it arrives. Either way the rest of the body is
  read and discarded (for at most ``LINGER_S``, as nginx's lingering close does) so the client
  sees the ``413`` instead of a reset connection, and the connection is then closed;
- the time limit between two reads (``--timeout-body``): ``408`` and the connection closed;
- a client that goes away mid-upload: one log line and a ``400`` (that nobody receives), never
  a traceback.

``parse_json(raw)`` accepts exactly the JSON that every client library writes and rejects with a
400, before any generation starts, what Python's ``json`` would let through and a handler later
trips over: ``NaN`` / ``Infinity`` and numbers that overflow to them (they cannot be written back
as JSON), integers too long to convert (``ValueError`` in ``json``), nesting deeper than
``MAX_JSON_DEPTH`` (``RecursionError`` there, or later in a template's ``tojson``), and lone UTF-16
surrogates (``"\\ud800"``) in any string or key, which no UTF-8 encoder (the tokenizer, the
response writer) accepts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from typing import Any

from starlette.requests import Request

from resin.server.errors import APIError

logger = logging.getLogger("resin.server")

MAX_JSON_DEPTH = 128
LINGER_S = 30.0  # at most this long spent discarding the rest of a refused body
_SURROGATE = re.compile("[\ud800-\udfff]")
CLOSE = {"connection": "close"}


def _client(request: Request) -> str:
    client = request.scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "client"


async def _discard(request: Request, timeout: float) -> None:
    deadline = time.monotonic() + LINGER_S
    while time.monotonic() < deadline:
        try:
            message = await asyncio.wait_for(request.receive(), timeout)
        except TimeoutError:
            return
        if message["type"] == "http.disconnect" or not message.get("more_body", False):
            return


def _too_large(limit: int, size: int | None) -> APIError:
    got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return APIError(
        413,
        f"the request body is {got}, over this server's limit of {limit} "
        "bytes (--max-request-body-bytes)",
        code="request_too_large",
        headers=CLOSE,
    )


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body; 413 over ``limit`` bytes, 408 when a read waits over ``timeout``."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        if request.headers.get("expect", "").lower() != "100-continue":
            await _discard(request, timeout)
        raise _too_large(limit, int(length))
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            message = await asyncio.wait_for(request.receive(), timeout)
        except TimeoutError:
            logger.warning(
                "%s %s: no request body data for %.0f s (--timeout-body); closing",
                _client(request),
                request.url.path,
                timeout,
            )
            raise APIError(
                408,
                f"the request body did not arrive within {timeout:g} s",
                code="request_timeout",
                headers=CLOSE,
            ) from None
        if message["type"] == "http.disconnect":
            logger.warning(
                "%s %s: client disconnected after %d bytes of the request body",
                _client(request),
                request.url.path,
                size,
            )
            raise APIError(400, "the client disconnected before the request body was complete")
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            chunks.clear()
            await _discard(request, timeout)
            raise _too_large(limit, None)
        if body:
            chunks.append(body)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _reject_constant(name: str) -> Any:
    raise APIError(400, f"the request body is not valid JSON: {name} is not a JSON number")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise APIError(
            400, f"the request body is not valid JSON: the number {text:.40} is out of range"
        )
    return value


def check_json_value(value: Any) -> None:
    """400 for nesting deeper than ``MAX_JSON_DEPTH`` or a lone surrogate in a string or key
    (iterative: a deep value cannot exhaust the stack here)."""
    if isinstance(value, str):
        value = [value]
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        container, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(
                400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep"
            )
        if isinstance(container, dict):
            for key in container:
                if not key.isascii() and _SURROGATE.search(key):
                    raise _surrogate()
            children = container.values()
        else:
            children = container
        for child in children:
            if isinstance(child, str):
                if not child.isascii() and _SURROGATE.search(child):
                    raise _surrogate()
            elif isinstance(child, (dict, list)):
                stack.append((child, depth + 1))


def _surrogate() -> APIError:
    return APIError(
        400,
        "the request body has a string with a lone UTF-16 surrogate (an unpaired "
        "\\ud800-\\udfff escape); it is not valid Unicode text",
    )


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object (see the module doc for what is refused)."""
    try:
        body = (
            json.loads(raw, parse_constant=_reject_constant, parse_float=_parse_float)
            if raw
            else None
        )
    except RecursionError:
        raise APIError(
            400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, over-long integers
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_json_value(body)
    return body
