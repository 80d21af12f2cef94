"""``POST /v1/responses``: the OpenAI Responses API, stateless, streaming and not (conformance §2).

The adapter follows :mod:`resin.server.openai.chat`: prepare (:mod:`.responses_request`: input
items and tools → chat messages → prompt; 400s before anything starts; the app runs it in a
worker thread for a large body) → start (engine
rejections become 400) → complete or stream, both through one :class:`OutputBuilder`
(:mod:`.responses_output`) over a :class:`ChatChoice`'s parser events.

Outcome of a generation:

- it stopped normally → ``status: "completed"`` (stream: ``response.completed``);
- it hit the requested ``max_output_tokens`` → ``status: "incomplete"``, ``incomplete_details:
  {"reason": "max_output_tokens"}``, the open item ``incomplete`` (stream: ``response.incomplete``);
- with no ``max_output_tokens`` it ran into the end of the context → ``status: "failed"`` with
  ``error.code: "context_length_exceeded"`` (what Codex maps to "context window exceeded"),
  output so far included (stream: ``response.failed``);
- the runner failed mid-stream → ``response.failed`` with ``error.code: "server_error"``
  (before the stream starts, or when not streaming, it is an HTTP error).

The stream is ``event: <type>`` + ``data: <json>`` per event, ``sequence_number`` 0, 1, 2, ...;
``response.created`` and ``response.in_progress`` first, then the items one at a time, then the
terminal event carrying the whole response (every output item and the five-field usage). When
the client goes away, the generator's ``finally`` aborts the generation at once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response

from resin.server.chat_output import ChatChoice
from resin.server.context import ServerContext
from resin.server.generation import Generation
from resin.server.openai.responses_output import (
    OutputBuilder,
    new_id,
    response_object,
    usage_object,
)
from resin.server.openai.responses_request import ResponsesRequest
from resin.server.sse import generation_response, named_event

TERMINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


async def create_response(ctx: ServerContext, request: ResponsesRequest) -> Response:
    """Start a request :func:`prepare_response` built, and answer it."""
    generation = ctx.start(request.generation, "resp")
    return await generation_response(
        request.stream,
        lambda: stream_response(ctx, request, generation),
        lambda: complete_response(ctx, request, generation),
        generation.abort,
        large=request.generation.num_top_logprobs is not None,
    )


class _Outcome:
    """How the generation ended: the response status and what goes with it."""

    def __init__(self, ctx: ServerContext, request: ResponsesRequest, choice: ChatChoice) -> None:
        self.incomplete_details: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        reason = choice.finish_reason
        if reason == "length" and request.max_output_tokens is not None:
            self.status = "incomplete"
            self.incomplete_details = {"reason": "max_output_tokens"}
        elif reason == "length":
            self.status = "failed"
            self.error = {
                "code": "context_length_exceeded",
                "message": (
                    f"The output reached this model's maximum context length of "
                    f"{ctx.max_model_len} tokens ({len(request.prompt.token_ids)} in the input)."
                ),
            }
        elif reason == "abort":
            self.status = "failed"
            self.error = {"code": "server_error", "message": "the generation was aborted"}
        else:
            self.status = "completed"
        self.item_status = "completed" if self.status == "completed" else "incomplete"


def _usage(ctx: ServerContext, generation: Generation, choice: ChatChoice) -> dict[str, Any]:
    reasoning = choice.reasoning
    reasoning_tokens = (
        len(ctx.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    )
    return usage_object(generation.usage, reasoning_tokens)


async def complete_response(
    ctx: ServerContext, request: ResponsesRequest, generation: Generation
) -> dict[str, Any]:
    response_id, created_at = new_id("resp"), int(time.time())
    choice = ChatChoice(ctx, request.prompt, request.tool_choice)
    builder = OutputBuilder(request.targets)
    async for batch in generation.deltas():
        for delta in batch:
            builder.feed(choice.events(delta), delta.logprobs)
    outcome = _Outcome(ctx, request, choice)
    builder.finish(outcome.item_status)
    return response_object(
        request,
        response_id,
        created_at,
        status=outcome.status,
        output=builder.items,
        usage=_usage(ctx, generation, choice),
        incomplete_details=outcome.incomplete_details,
        error=outcome.error,
    )


async def stream_response(
    ctx: ServerContext, request: ResponsesRequest, generation: Generation
) -> AsyncIterator[str]:
    response_id, created_at = new_id("resp"), int(time.time())
    sequence = itertools.count()
    choice = ChatChoice(ctx, request.prompt, request.tool_choice)
    builder = OutputBuilder(request.targets)

    def event(kind: str, payload: dict[str, Any]) -> str:
        return named_event(kind, {"type": kind, "sequence_number": next(sequence), **payload})

    try:
        initial = response_object(request, response_id, created_at, status="in_progress", output=[])
        yield event("response.created", {"response": initial})
        yield event("response.in_progress", {"response": initial})
        try:
            async for batch in generation.deltas():
                for delta in batch:
                    for kind, payload in builder.feed(choice.events(delta), delta.logprobs):
                        yield event(kind, payload)
        except Exception as exc:  # noqa: BLE001 - the runner failed: report it in-stream
            for kind, payload in builder.finish("incomplete"):
                yield event(kind, payload)
            failed = response_object(
                request,
                response_id,
                created_at,
                status="failed",
                output=builder.items,
                usage=_usage(ctx, generation, choice),
                error={"code": "server_error", "message": f"generation failed: {exc}"},
            )
            yield event("response.failed", {"response": failed})
            return
        outcome = _Outcome(ctx, request, choice)
        for kind, payload in builder.finish(outcome.item_status):
            yield event(kind, payload)
        final = response_object(
            request,
            response_id,
            created_at,
            status=outcome.status,
            output=builder.items,
            usage=_usage(ctx, generation, choice),
            incomplete_details=outcome.incomplete_details,
            error=outcome.error,
        )
        yield event(TERMINAL_EVENTS[outcome.status], {"response": final})
    finally:
        generation.abort()
