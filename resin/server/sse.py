"""Server-sent events: the two wire shapes the APIs use, and the streaming response.

OpenAI chat/completions streams are ``data: <json>\\n\\n`` lines only, ending ``data: [DONE]``
(no ``event:`` lines, no comments: sglang's benchmark ``json.loads`` every line). Anthropic
Messages and OpenAI Responses streams put ``event: <type>`` before each ``data:`` line (the
Anthropic SDK dispatches on the ``event:`` field). JSON is compact and keeps non-ASCII as is.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def data_event(value: Any) -> str:
    return f"data: {dumps(value)}\n\n"


def named_event(event_type: str, value: dict[str, Any]) -> str:
    return f"event: {event_type}\ndata: {dumps(value)}\n\n"


class EventStreamResponse(StreamingResponse):
    """A streamed response that runs ``on_close`` however it ends — finished, failed, or the
    client gone before the first event was produced (the body generator may then never start,
    so its own ``finally`` would not run; this does, and aborts the request at once)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def sse_response(events: AsyncIterator[str], on_close: Callable[[], None]) -> StreamingResponse:
    """``text/event-stream`` response; ``on_close`` aborts the generation behind it."""
    return EventStreamResponse(events, on_close)
