"""Server-sent events: the two wire shapes the APIs use, and the streaming response.

OpenAI chat/completions streams are ``data: <json>\\n\\n`` lines only, ending ``data: [DONE]``
(no ``event:`` lines, no comments: sglang's benchmark ``json.loads`` every line). Anthropic
Messages and OpenAI Responses streams put ``event: <type>`` before each ``data:`` line (the
Anthropic SDK dispatches on the ``event:`` field). JSON is compact and keeps non-ASCII as is.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def data_event(value: Any) -> str:
    return f"data: {dumps(value)}\n\n"


def named_event(event_type: str, value: dict[str, Any]) -> str:
    return f"event: {event_type}\ndata: {dumps(value)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
