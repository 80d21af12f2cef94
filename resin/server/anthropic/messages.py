"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the Anthropic Messages API.

This module owns the request flow (conformance §3): :func:`prepare` validates the body, converts
it (:mod:`.convert`) and renders the prompt; ``max_tokens`` is required and clamped to the room
left in the context rather than refused (Claude Code asks for 32k/64k whatever the model's
context). Sampling takes only ``temperature`` (0–1), ``top_p`` and ``top_k`` from the body;
``stop_sequences`` become stop strings. ``thinking.display: "omitted"`` sends thinking blocks
without their text (signature kept); ``output_config.format`` (structured output) is a 400 until
constrained decoding exists (``output_config.effort`` is accepted and ignored). The output goes through a :class:`ChatChoice`
(reasoning and tool-call parsers) and a :class:`BlockWriter` (:mod:`.blocks`) into either

- one ``message`` object (:func:`complete`), or
- the SSE stream (:func:`stream`): ``message_start`` (sent with the first output, when the
  prompt's cache hits are known), the ``content_block_*`` events, ``message_delta`` (stop reason,
  cumulative usage) and ``message_stop``, with a ``ping`` whenever nothing was sent for
  ``PING_INTERVAL_S`` (a long prefill). A runner failure mid-stream becomes an
  ``event: error`` with an ``api_error`` body. However the stream ends (a client disconnect
  included), the generation is aborted in ``finally``, so its pages return to the pool at once.

``count_tokens`` renders through the same conversion and template as ``/v1/messages`` and
returns ``{"input_tokens": N}``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi.responses import Response

from resin.server.anthropic.blocks import BlockWriter, stop_reason, usage_body
from resin.server.anthropic.convert import build_prompt
from resin.server.chat_output import ChatChoice, skip_special_tokens
from resin.server.chat_prompt import ChatPrompt
from resin.server.context import ServerContext
from resin.server.engine_loop import RunnerFailure
from resin.server.errors import APIError
from resin.server.generation import Generation, GenerationRequest
from resin.server.ids import random_id
from resin.server.request_fields import get_bool, get_dict, get_int, get_stop
from resin.server.sampling_request import max_tokens_for, sampling_params
from resin.server.sse import generation_response, named_event
from resin.server.structured import request_grammar, tool_param_paths

SAMPLING_FIELDS = ("temperature", "top_p", "top_k")
PING_INTERVAL_S = 10.0  # conformance §3.4: a ping every 10-15 s while nothing else is sent
PING = named_event("ping", {"type": "ping"})
T = TypeVar("T")


@dataclass
class MessageRequest:
    model: str  # echoed back as sent
    prompt: ChatPrompt
    tool_choice: Any
    generation_request: GenerationRequest
    stream: bool
    clamped: bool = False  # max_tokens was cut to the room left in the context
    omit_thinking: bool = False  # thinking.display == "omitted"


def prepare(ctx: ServerContext, body: dict[str, Any]) -> MessageRequest:
    """Validate and convert a request, render and tokenize its prompt (no engine work: the app
    runs this in a worker thread for a large body)."""
    model = ctx.check_model(body.get("model"), anthropic=True)
    if body.get("max_tokens") is None:
        raise APIError(400, "max_tokens: Field required", param="max_tokens")
    output_config = get_dict(body, "output_config") or {}
    if output_config.get("format") is not None:
        raise APIError(
            400,
            "output_config.format (structured output) is not supported yet: "
            "the output would not be constrained to the schema; send the request "
            "without it",
            param="output_config.format",
        )
    thinking = body.get("thinking")
    omit_thinking = isinstance(thinking, dict) and thinking.get("display") == "omitted"
    requested = get_int(body, "max_tokens", minimum=1)
    stream = get_bool(body, "stream", False)
    stops = get_stop(body, "stop_sequences")
    prompt, tool_choice = build_prompt(ctx, body)
    max_tokens = max_tokens_for(
        requested, len(prompt.token_ids), ctx.max_model_len, clamp=True, anthropic=True
    )
    sampling_body = {name: body[name] for name in SAMPLING_FIELDS if name in body}
    params = sampling_params(
        ctx.sampling_defaults,
        sampling_body,
        max_tokens=max_tokens,
        num_logprobs=None,
        temperature_max=1.0,
    )
    paths = tool_param_paths(prompt.tools, body.get("tools"), _tool_path)
    grammar = request_grammar(ctx, prompt.tools, tool_choice, paths, None, prompt)
    request = GenerationRequest(
        prompt.token_ids,
        params,
        stop=stops,
        skip_special_tokens=skip_special_tokens(ctx, prompt, tool_choice),
        grammar=grammar,
    )
    return MessageRequest(
        model,
        prompt,
        tool_choice,
        request,
        stream,
        clamped=requested is not None and max_tokens < requested,
        omit_thinking=omit_thinking,
    )


def _tool_path(position: int, tool: Any) -> tuple[str, str] | None:
    name = tool.get("name")
    return (name, f"tools[{position}].input_schema") if isinstance(name, str) else None


async def create_message(ctx: ServerContext, request: MessageRequest) -> Response:
    """Start a request :func:`prepare` built, and answer it."""
    generation = ctx.start(request.generation_request, "msg")
    return await generation_response(
        request.stream,
        lambda: stream(ctx, request, generation),
        lambda: complete(ctx, request, generation),
        generation.abort,
    )


def count_tokens(ctx: ServerContext, body: dict[str, Any]) -> dict[str, Any]:
    ctx.check_model(body.get("model"), anthropic=True)
    prompt, _ = build_prompt(ctx, body, check_length=False)
    return {"input_tokens": len(prompt.token_ids)}


def message_id() -> str:
    return random_id("msg_")


async def complete(
    ctx: ServerContext, request: MessageRequest, generation: Generation
) -> dict[str, Any]:
    choice = ChatChoice(ctx, request.prompt, request.tool_choice)
    writer = BlockWriter(omit_thinking=request.omit_thinking)
    try:
        async for batch in generation.deltas():
            for delta in batch:
                writer.feed(choice.events(delta))
    except RunnerFailure as exc:  # the runner failed: 500 api_error
        raise APIError(500, f"generation failed: {exc}") from exc
    writer.finish()
    reason, sequence = stop_reason(
        choice.finish_reason, choice.stop_string, choice.num_tool_calls, request.clamped
    )
    return {
        "id": message_id(),
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": writer.content(),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_body(generation.usage),
    }


async def stream(
    ctx: ServerContext, request: MessageRequest, generation: Generation
) -> AsyncIterator[str]:
    choice = ChatChoice(ctx, request.prompt, request.tool_choice)
    writer = BlockWriter(omit_thinking=request.omit_thinking)
    started = False
    batches = with_pings(generation.deltas(), PING_INTERVAL_S)
    try:
        async for batch in batches:
            if batch is None:
                yield PING
                continue
            if not started:
                started = True
                yield _message_start(request.model, generation)
            for delta in batch:
                for event in writer.feed(choice.events(delta)):
                    yield event
        if not started:  # nothing came back at all (an aborted request)
            yield _message_start(request.model, generation)
        for event in writer.finish():
            yield event
        reason, sequence = stop_reason(
            choice.finish_reason, choice.stop_string, choice.num_tool_calls, request.clamped
        )
        yield named_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage_body(generation.usage),
            },
        )
        yield named_event("message_stop", {"type": "message_stop"})
    except Exception as exc:  # noqa: BLE001 - the runner failed: report it in-stream
        yield named_event(
            "error",
            {
                "type": "error",
                "error": {"type": "api_error", "message": f"generation failed: {exc}"},
            },
        )
    finally:
        generation.abort()
        await batches.aclose()  # cancels its pending read at once (no await inside)


async def with_pings(batches: AsyncIterator[T], interval: float) -> AsyncGenerator[T | None, None]:
    """``batches``, with ``None`` after every ``interval`` seconds without one (a long prefill,
    a slow step): the caller sends a ``ping`` so proxies and clients see a live stream. When
    this generator is closed or cancelled, the pending read is cancelled, which ends
    ``batches`` (its ``finally`` runs)."""
    iterator = aiter(batches)
    pending: asyncio.Future[T] = asyncio.ensure_future(anext(iterator))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            try:
                batch = pending.result()
            except StopAsyncIteration:
                return
            yield batch
            pending = asyncio.ensure_future(anext(iterator))
    finally:
        pending.cancel()


def _message_start(model: str, generation: Generation) -> str:
    return named_event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": message_id(),
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage_body(generation.usage),
            },
        },
    )
