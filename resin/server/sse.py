"""Server-sent events: the two wire shapes the APIs use, the streaming response, and the one
way every endpoint answers for a generation (stream or JSON, aborted when the exchange ends).

OpenAI chat/completions streams are ``data: <json>\\n\\n`` lines only, ending ``data: [DONE]``
(no ``event:`` lines, no comments: sglang's benchmark ``json.loads`` every line). Anthropic
Messages and OpenAI Responses streams put ``event: <type>`` before each ``data:`` line (the
Anthropic SDK dispatches on the ``event:`` field). JSON is compact, keeps non-ASCII as is, and
never contains ``NaN`` / ``Infinity`` (``allow_nan=False``: requests with them are refused, and
logprobs are finite).

A non-streaming answer that can be large (logprobs, several choices) is written by
:class:`IncrementalJSONResponse`: the body is encoded piece by piece (no single ``json.dumps``
call over more than one slice of a long list) and sent in ~64 KiB chunks, yielding to the event
loop between chunks — an 80 MB body neither blocks other clients for its whole encoding time
nor sits in memory twice (object and text).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


CHUNK_BYTES = 64 * 1024
SPLIT_DICT_DEPTH = 6  # objects this shallow are written key by key
SPLIT_LIST_DEPTH = 4  # arrays this shallow item by item; deeper ones ...
LIST_SLICE = 32  # ... in slices of this many items, one dumps call each


class RawJSON:
    """JSON text already encoded, written as is by :func:`json_pieces` (plain ``dumps``
    refuses it: only :class:`IncrementalJSONResponse` bodies may hold one). A large answer's
    logprobs are built as text: a million small dicts would cost as much again to encode, and
    their number makes the cyclic GC's full passes pause every client for up to a second."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def json_pieces(value: Any, depth: int = 0) -> Iterator[str]:
    """``dumps(value)`` as a sequence of strings (their concatenation), none of them the
    encoding of a whole big container: a response's logprob lists sit 4-5 levels deep."""
    if isinstance(value, RawJSON):
        yield value.text
    elif isinstance(value, dict) and value and depth < SPLIT_DICT_DEPTH:
        separator = "{"
        for key, item in value.items():
            yield separator + dumps(str(key)) + ":"
            separator = ","
            yield from json_pieces(item, depth + 1)
        yield "}"
    elif isinstance(value, list) and value and depth < SPLIT_LIST_DEPTH:
        separator = "["
        for item in value:
            yield separator
            separator = ","
            yield from json_pieces(item, depth + 1)
        yield "]"
    elif isinstance(value, list) and len(value) > LIST_SLICE:
        yield "["
        for start in range(0, len(value), LIST_SLICE):
            part = dumps(value[start : start + LIST_SLICE])[1:-1]
            yield part if start == 0 else "," + part
        yield "]"
    else:
        yield dumps(value)


class IncrementalJSONResponse(Response):
    """``application/json`` written in chunks as it is encoded (see the module doc)."""

    media_type = "application/json"

    def __init__(self, content: Any) -> None:
        self.content = content
        self.status_code = 200
        self.background = None
        self.init_headers()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        buffer: list[str] = []
        size = 0
        for piece in json_pieces(self.content):
            buffer.append(piece)
            size += len(piece)
            if size >= CHUNK_BYTES:
                await send(
                    {
                        "type": "http.response.body",
                        "body": "".join(buffer).encode(),
                        "more_body": True,
                    }
                )
                buffer.clear()
                size = 0
                await asyncio.sleep(0)  # let the event loop serve others between chunks
        await send(
            {"type": "http.response.body", "body": "".join(buffer).encode(), "more_body": False}
        )


def data_event(value: Any) -> str:
    return f"data: {dumps(value)}\n\n"


def named_event(event_type: str, value: dict[str, Any]) -> str:
    return f"event: {event_type}\ndata: {dumps(value)}\n\n"


class EventStreamResponse(Response):
    """A ``text/event-stream`` response: each event is written as soon as it is produced.

    A watcher task waits for the client's ``http.disconnect`` and cancels the stream at once
    (the body generator's ``finally`` then aborts the generation). ``on_close`` runs however
    the response ends — finished, failed, or the client gone before the body generator ever
    started. Starlette's ``StreamingResponse`` does the same with an anyio task group; this
    does it with one plain asyncio task, which costs less per request.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        disconnected = False

        async def watch_disconnect() -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch_disconnect())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send(
                    {"type": "http.response.body", "body": event.encode(), "more_body": True}
                )
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not disconnected:
                raise
            task.uncancel()  # our own cancellation: the client left, the response is over
        finally:
            watcher.cancel()
            self.on_close()
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()  # run the body generator's own cleanup now, not at GC


def sse_response(events: AsyncIterator[str], on_close: Callable[[], None]) -> Response:
    """``text/event-stream`` response; ``on_close`` aborts the generation behind it."""
    return EventStreamResponse(events, on_close)


async def generation_response(
    stream: bool,
    events: Callable[[], AsyncIterator[str]],
    body: Callable[[], Awaitable[dict[str, Any]]],
    abort: Callable[[], None],
    *,
    large: bool = False,
) -> Response:
    """Every endpoint's answer for a started generation: ``events()`` as a stream, or
    ``body()`` as JSON (written incrementally when ``large``: logprobs or several choices);
    either way ``abort`` runs when the response is over, so no request outlives its HTTP
    exchange."""
    if stream:
        return sse_response(events(), abort)
    try:
        content = await body()
    finally:
        abort()
    return IncrementalJSONResponse(content) if large else JSONResponse(content)
