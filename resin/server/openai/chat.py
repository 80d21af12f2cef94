"""``POST /v1/chat/completions``: OpenAI Chat Completions, streaming and not (conformance §1).

Request → normalised messages and tools → chat template → :class:`GenerationRequest` (``n``
choices, stop strings, logprobs) → :class:`Generation`; each choice's text goes through a
:class:`ChatChoice` (reasoning and tool-call parsers) and comes back as ``message`` (with
``tool_calls``, ``reasoning`` and ``reasoning_content``) or as ``chat.completion.chunk`` deltas:
role first (with the first token), then content / reasoning / tool-call fragments, a final
``delta: {}`` chunk with ``finish_reason`` per choice, the usage chunk only when
``stream_options.include_usage`` is set, and ``data: [DONE]``.

vLLM's ``return_token_ids: true`` adds ``prompt_token_ids`` (top level; in a stream, on each
choice's first chunk) and per-choice ``token_ids`` (the completion's ids, the stop token
included; in a stream, each chunk's new ids). A request whose logprobs could make the response
huge (n × max_tokens × (1 + top_logprobs) over ``--max-logprob-entries``) is a 400.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from resin.server.chat_output import ChatChoice, parse_tool_choice, skip_special_tokens
from resin.server.chat_prompt import (
    build_chat_prompt,
    normalize_chat_messages,
    normalize_tools,
)
from resin.server.context import ServerContext
from resin.server.errors import APIError, openai_stream_error
from resin.server.generation import Generation, GenerationRequest, TokenLogprob, Usage
from resin.server.ids import random_id
from resin.server.parsers import (
    ContentDelta,
    OutputEvent,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallStart,
)
from resin.server.request_fields import get_bool, get_dict, get_int, get_stop, get_str
from resin.server.sampling_request import (
    MAX_TOP_LOGPROBS,
    max_tokens_for,
    sampling_params,
)
from resin.server.sse import DONE, RawJSON, data_event, dumps
from resin.server.structured import parse_format, request_grammar, tool_param_paths

MAX_N = 128


def request_chat_template(ctx: ServerContext, body: dict[str, Any]) -> str | None:
    """A template sent in the request: only with ``--trust-request-chat-template`` (it runs on
    the server; a hostile one could spin the event loop), as vLLM does."""
    template = get_str(body, "chat_template")
    if template is not None and not ctx.options.trust_request_chat_template:
        raise APIError(
            400,
            "a chat_template was sent with the request, but the server was not "
            "started with --trust-request-chat-template",
            param="chat_template",
        )
    return template


def check_stream_fields(body: dict[str, Any]) -> None:
    """``stream`` and ``stream_options`` are checked before a response starts: a bad value is a
    400, not an error after the 200 header of a stream."""
    get_bool(body, "stream", False)
    options = get_dict(body, "stream_options")
    if options is not None:
        get_bool(options, "include_usage", False)


LOGPROBS_SLICE = 32  # tokens' logprob entries built between two yields to the event loop


TokenBytes = Callable[[int, str], bytes]
"""(token id, its text) -> the token's bytes (``Generation.token_bytes``: a token holding part
of a character has its own bytes, not U+FFFD's)."""


def _text_bytes(token_id: int, text: str) -> bytes:
    return text.encode()


def logprobs_content(
    entries: list[TokenLogprob], token_bytes: TokenBytes = _text_bytes
) -> list[dict[str, Any]]:
    """``logprobs.content`` of a chat choice (a stream's chunk: a few tokens)."""
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(token_bytes(e.token_id, e.token)),
            "top_logprobs": [
                {"token": t, "logprob": lp, "bytes": list(token_bytes(i, t))} for i, t, lp in e.top
            ],
        }
        for e in entries
    ]


class LogprobFragments:
    """:func:`logprobs_content` as JSON text (the same bytes ``dumps`` gives: compact, floats by
    ``repr``), each token's ``"token":...`` and ``"bytes":[...]`` encoded once."""

    def __init__(self, token_bytes: TokenBytes = _text_bytes) -> None:
        self._token: dict[int, tuple[str, str]] = {}
        self._token_bytes = token_bytes

    def _encoded(self, token_id: int, text: str) -> tuple[str, str]:
        pair = self._token.get(token_id)
        if pair is None:
            pair = self._token[token_id] = (
                '{"token":' + dumps(text) + ',"logprob":',
                ',"bytes":' + dumps(list(self._token_bytes(token_id, text))),
            )
        return pair

    def content(self, entries: list[TokenLogprob]) -> str:
        """The entries of ``logprobs_content(entries)``, comma-separated (no brackets)."""
        out = []
        for e in entries:
            head, tail = self._encoded(e.token_id, e.token)
            top = []
            for token_id, text, logprob in e.top:
                h, t = self._encoded(token_id, text)
                top.append(f"{h}{logprob!r}{t}}}")
            out.append(f'{head}{e.logprob!r}{tail},"top_logprobs":[{",".join(top)}]}}')
        return ",".join(out)


def usage_body(usage: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": reasoning_tokens},
    }


def chat_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The template kwargs of a chat request: Chat Completions' top-level ``reasoning_effort``
    (``"none"`` also turns thinking off, as the Responses API's ``reasoning.effort`` does), then
    vLLM's ``chat_template_kwargs``, which win."""
    kwargs: dict[str, Any] = {}
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise APIError(400, "'reasoning_effort' must be a string", param="reasoning_effort")
        kwargs["reasoning_effort"] = effort
        if effort == "none":
            kwargs["enable_thinking"] = False
    kwargs.update(get_dict(body, "chat_template_kwargs") or {})
    return kwargs


def prepare_chat(
    ctx: ServerContext, body: dict[str, Any]
) -> tuple[str, GenerationRequest, Any, Any]:
    """Validate a chat request; return (model, generation request, prompt, tool_choice)."""
    model = ctx.check_model(body.get("model"))
    check_stream_fields(body)
    messages = normalize_chat_messages(body.get("messages"))
    tools = normalize_tools(body.get("tools"))
    tool_choice = parse_tool_choice(body.get("tool_choice"), tools)
    prompt = build_chat_prompt(
        ctx,
        messages,
        tools,
        chat_template_kwargs(body),
        request_chat_template(ctx, body),
        continue_final_message=get_bool(body, "continue_final_message", False),
    )
    if not get_bool(body, "parallel_tool_calls", True):
        prompt = replace(prompt, max_tool_calls=1)
    n = get_int(body, "n", 1, minimum=1, maximum=MAX_N)
    num_logprobs = None
    if body.get("top_logprobs") is not None and not get_bool(body, "logprobs", False):
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if get_bool(body, "logprobs", False):
        num_logprobs = get_int(body, "top_logprobs", 0, minimum=0, maximum=MAX_TOP_LOGPROBS)
    requested = get_int(body, "max_completion_tokens", minimum=1)
    if requested is None:
        requested = get_int(body, "max_tokens", minimum=1)
    max_tokens = max_tokens_for(requested, len(prompt.token_ids), ctx.max_model_len)
    ctx.check_logprob_entries(n or 1, max_tokens, num_logprobs)
    get_bool(body, "return_token_ids", False)
    params = sampling_params(
        ctx.sampling_defaults,
        body,
        max_tokens=max_tokens,
        num_logprobs=num_logprobs,
        vocab_size=ctx.vocab_size,
    )
    output_format = parse_format(body.get("response_format"), "response_format", nested=True)
    paths = tool_param_paths(tools, body.get("tools"), _chat_tool_path)
    grammar = request_grammar(ctx, tools, tool_choice, paths, output_format, prompt)
    request = GenerationRequest(
        prompt.token_ids,
        params,
        n=n or 1,
        stop=get_stop(body, "stop"),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=skip_special_tokens(
            ctx, prompt, tool_choice, get_bool(body, "skip_special_tokens", True)
        ),
        num_top_logprobs=num_logprobs,
        grammar=grammar,
    )
    return model, request, prompt, tool_choice


def _chat_tool_path(position: int, tool: Any) -> tuple[str, str] | None:
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    return function["name"], f"tools[{position}].function.parameters"


def delta_body(events: list[OutputEvent], emit_reasoning_content: bool) -> dict[str, Any]:
    """The ``delta`` of one chunk from one choice's parser events."""
    content, reasoning = [], []
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls[event.index] = {
                "index": event.index,
                "id": event.call_id,
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
        elif isinstance(event, ToolCallArgumentsDelta):
            call = calls.setdefault(
                event.index, {"index": event.index, "function": {"arguments": ""}}
            )
            call["function"]["arguments"] += event.text
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = "".join(content)
    if reasoning:
        delta["reasoning"] = "".join(reasoning)
        if emit_reasoning_content:
            delta["reasoning_content"] = delta["reasoning"]
    if calls:
        delta["tool_calls"] = [calls[i] for i in sorted(calls)]
    return delta


async def stream_chat(
    ctx: ServerContext,
    model: str,
    generation: Generation,
    prompt: Any,
    tool_choice: Any,
    body: dict[str, Any],
) -> AsyncIterator[str]:
    chunk_id = random_id("chatcmpl-", 32)
    options = get_dict(body, "stream_options") or {}
    include_usage = bool(options.get("include_usage"))
    head = dumps(
        {
            "id": chunk_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": None,
        }
    )[:-1]
    tail = ',"usage":null}\n\n' if include_usage else "}\n\n"
    choices = [ChatChoice(ctx, prompt, tool_choice) for _ in range(generation.request.n)]
    started = [False] * len(choices)
    emit_rc = ctx.options.emit_reasoning_content
    # vLLM's return_token_ids: the prompt's ids on each choice's first chunk, every chunk's
    # new completion ids on its choice (they concatenate to the non-streaming token_ids)
    return_ids = body.get("return_token_ids") is True
    prompt_ids = f',"prompt_token_ids":{dumps(prompt.token_ids)}' if return_ids else ""
    try:
        async for batch in generation.deltas():
            for delta in batch:
                choice = choices[delta.index]
                body_delta = delta_body(choice.events(delta), emit_rc)
                if not started[delta.index]:
                    # A role-only chunk opens each choice, as OpenAI and vLLM send it: the
                    # SDK's stream accumulator counts a first chunk's logprobs twice otherwise
                    # (for every choice but the first to arrive).
                    started[delta.index] = True
                    opening = {
                        "index": delta.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    if return_ids:
                        opening["token_ids"] = []
                    yield f'data: {head}{prompt_ids},"choices":[{dumps(opening)}]{tail}'
                # held-back text still reports its logprobs and token ids
                if body_delta or delta.logprobs or (return_ids and delta.token_ids):
                    entry: dict[str, Any] = {
                        "index": delta.index,
                        "delta": body_delta,
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    if delta.logprobs:
                        entry["logprobs"] = {
                            "content": logprobs_content(delta.logprobs, generation.token_bytes),
                            "refusal": None,
                        }
                    if return_ids:
                        entry["token_ids"] = delta.token_ids
                    yield f'data: {head},"choices":[{dumps(entry)}]{tail}'
                if choice.finish_reason is not None:
                    final: dict[str, Any] = {
                        "index": delta.index,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": _finish_reason(choice.finish_reason),
                    }
                    if choice.stop_string is not None:
                        final["stop_reason"] = choice.stop_string
                    if return_ids:
                        final["token_ids"] = []
                    yield f'data: {head},"choices":[{dumps(final)}]{tail}'
    except Exception as exc:  # noqa: BLE001 - the runner failed: report it in-stream
        yield data_event(openai_stream_error(exc))
        return
    if include_usage:
        reasoning_tokens = sum(_count_tokens(ctx, c.reasoning) for c in choices)
        yield (
            f'data: {head},"choices":[],"usage":'
            f"{dumps(usage_body(generation.usage, reasoning_tokens))}}}\n\n"
        )
    yield DONE


def _finish_reason(reason: str) -> str:
    return "stop" if reason == "abort" else reason


def _count_tokens(ctx: ServerContext, text: str) -> int:
    return len(ctx.tokenizer.encode(text, add_special_tokens=False)) if text else 0


async def complete_chat(
    ctx: ServerContext,
    model: str,
    generation: Generation,
    prompt: Any,
    tool_choice: Any,
    *,
    return_token_ids: bool = False,
) -> dict[str, Any]:
    choices = [ChatChoice(ctx, prompt, tool_choice) for _ in range(generation.request.n)]
    token_ids: list[list[int]] = [[] for _ in choices]
    async for batch in generation.deltas():
        for delta in batch:
            choices[delta.index].events(delta)
            if return_token_ids:
                token_ids[delta.index].extend(delta.token_ids)
    result_choices = await _choice_bodies(ctx, generation, choices, token_ids, return_token_ids)
    reasoning_tokens = sum(_count_tokens(ctx, c.reasoning) for c in choices)
    result = {
        "id": random_id("chatcmpl-", 32),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": result_choices,
        "usage": usage_body(generation.usage, reasoning_tokens),
    }
    if return_token_ids:
        result["prompt_token_ids"] = prompt.token_ids
    return result


async def _choice_bodies(
    ctx: ServerContext,
    generation: Generation,
    choices: list[ChatChoice],
    token_ids: list[list[int]],
    return_token_ids: bool,
) -> list[dict[str, Any]]:
    """The ``choices`` of a finished chat completion. Their logprobs are built here as JSON
    text (:class:`~resin.server.sse.RawJSON`: 128 choices of 300 tokens with 20 top entries
    each are 800k entries), and the loop yields after every ``LOGPROBS_SLICE`` tokens', so
    other clients are served meanwhile. (A thread would not help: it holds the GIL.)"""
    result_choices = []
    for index, choice in enumerate(choices):
        calls = [
            {
                "id": c.call_id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in choice.tool_calls
        ]
        content = choice.content
        message: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not calls else None,
            "refusal": None,
            "tool_calls": calls,
        }
        if choice.reasoning:
            message["reasoning"] = choice.reasoning
            if ctx.options.emit_reasoning_content:
                message["reasoning_content"] = choice.reasoning
        entry: dict[str, Any] = {
            "index": index,
            "message": message,
            "logprobs": None,
            "finish_reason": _finish_reason(choice.finish_reason or "stop"),
        }
        if choice.stop_string is not None:
            entry["stop_reason"] = choice.stop_string
        if generation.request.num_top_logprobs is not None:
            parts, fragments = [], LogprobFragments(generation.token_bytes)
            for start in range(0, len(choice.logprobs), LOGPROBS_SLICE):
                parts.append(fragments.content(choice.logprobs[start : start + LOGPROBS_SLICE]))
                await asyncio.sleep(0)
            text = "[" + ",".join(p for p in parts if p) + "]"
            entry["logprobs"] = {"content": RawJSON(text), "refusal": None}
        if return_token_ids:
            entry["token_ids"] = token_ids[index]
        result_choices.append(entry)
    return result_choices
