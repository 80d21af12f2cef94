"""Responses API output: parser events → output items and the stream events that build them.

:class:`OutputBuilder` is the one state machine behind both the streamed and the complete
response (so the two cannot disagree). It takes a choice's parser events
(:mod:`resin.server.parsers.events`) and keeps ``items``, the response's ``output``, with ONE
item open at a time, in generation order — reasoning (``rs_``), then the message (``msg_``),
then the calls (``fc_`` / ``ctc_``) for the usual output — and returns the conformance §2.3
events for each step as ``(type, payload)`` pairs (no ``sequence_number``; the stream numbers
them):

- reasoning: ``output_item.added`` → ``content_part.added`` (``reasoning_text``) →
  ``reasoning_text.delta``\\* → ``reasoning_text.done`` → ``content_part.done`` →
  ``output_item.done``;
- message: the same with an ``output_text`` part and ``output_text.delta``/``.done``;
- function call: ``output_item.added`` (``arguments: ""``) → ``function_call_arguments.delta``\\*
  → ``function_call_arguments.done`` → ``output_item.done``; the name is the client's name, with
  ``namespace`` for a namespace tool;
- custom tool call (the model called the internal ``input``-only function of a ``custom``
  tool): ``output_item.added`` (``custom_tool_call``, ``input: ""``) →
  ``custom_tool_call_input.delta`` (the whole raw input, once the call's JSON is complete) →
  ``custom_tool_call_input.done`` → ``output_item.done``.

Every ``output_item.done`` carries the complete item (Codex executes tools from it). A message that
follows a reasoning item starts at its first non-newline character (Qwen-style templates put
``</think>\n\n`` between the two). A response that produced no item at all gets one empty
message, so ``output_text`` is always there.

Logprobs (when requested) ride on ``output_text.delta`` events: each text delta carries the
tokens delivered since the previous one (tokens whose text the detokenizer or a parser held
back wait for the next delta, or for the ``.done`` event), and the message's part carries them
all. Tokens of a delivery batch that produced reasoning or tool calls but no message text are
not reported; in a batch that produced both, all its tokens go to the message.

Also here: :func:`response_object` (the §2.2 ``Response``) and :func:`usage_object` (all five
usage fields — Codex rejects a partial usage).
"""

from __future__ import annotations

import json
import time
from typing import Any

from resin.server.generation import TokenLogprob, Usage
from resin.server.ids import random_id
from resin.server.openai.responses_request import ResponsesRequest, ToolTarget
from resin.server.parsers import (
    ContentDelta,
    OutputEvent,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)

WireEvent = tuple[str, dict[str, Any]]


def new_id(prefix: str) -> str:
    return random_id(f"{prefix}_", 32)


def logprobs_entries(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.token.encode()),
            "top_logprobs": [
                {"token": t, "logprob": lp, "bytes": list(t.encode())} for _, t, lp in e.top
            ],
        }
        for e in entries
    ]


def custom_input(arguments: str) -> str:
    """The raw ``input`` of a custom tool from the internal function's JSON arguments."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, dict):
        if isinstance(value.get("input"), str):
            return value["input"]
        strings = [v for v in value.values() if isinstance(v, str)]
        if len(value) == 1 and strings:  # the model named the one parameter differently
            return strings[0]
    return arguments


class OutputBuilder:
    """Output items of one response, built from parser events; see the module docstring."""

    def __init__(self, targets: dict[str, ToolTarget]) -> None:
        self.targets = targets
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the open item (last of ``items``)
        self._text: list[str] = []  # the open reasoning/message item's text
        self._logprobs: list[dict[str, Any]] = []  # the open message's logprobs
        self._pending_logprobs: list[dict[str, Any]] = []  # tokens whose text is held back

    # -- feeding ---------------------------------------------------------------------------
    def feed(
        self, events: list[OutputEvent], logprobs: list[TokenLogprob] | None = None
    ) -> list[WireEvent]:
        out: list[WireEvent] = []
        if logprobs:
            self._pending_logprobs.extend(logprobs_entries(logprobs))
        if not any(isinstance(e, ContentDelta) for e in events) and events:
            self._pending_logprobs = []  # these tokens went to reasoning or a tool call
        for event in events:
            if isinstance(event, ReasoningDelta):
                self._text_delta(out, "reasoning", event.text, [])
            elif isinstance(event, ContentDelta):
                self._text_delta(out, "message", event.text, self._pending_logprobs)
                self._pending_logprobs = []
            elif isinstance(event, ToolCallStart):
                self._close(out, "completed")
                self._open_call(out, event)
            elif isinstance(event, ToolCallArgumentsDelta):
                self._arguments_delta(out, event.text)
            elif isinstance(event, ToolCallEnd):
                # a cut call is not one to run (Codex runs a completed function_call item)
                self._end_call(out, event.arguments, "incomplete" if event.cut else "completed")
        return out

    def finish(self, status: str = "completed") -> list[WireEvent]:
        """Close the open item (``status`` ``"incomplete"`` when generation was cut short);
        add an empty message if nothing was produced."""
        out: list[WireEvent] = []
        if self._open is not None and self._open["type"] == "message":
            self._logprobs.extend(self._pending_logprobs)
        self._pending_logprobs = []
        self._close(out, status)
        if not self.items:
            self._open_text(out, "message")
            self._close(out, status)
        return out

    # -- text items ------------------------------------------------------------------------
    def _text_delta(
        self, out: list[WireEvent], kind: str, text: str, logprobs: list[dict[str, Any]]
    ) -> None:
        opening = self._open is None or self._open["type"] != kind
        if opening and kind == "message" and self.items and self.items[-1]["type"] == "reasoning":
            text = text.lstrip("\n")  # the ``</think>\n\n`` separator is not message text
        if not text:
            return
        if opening:
            self._close(out, "completed")
            self._open_text(out, kind)
        assert self._open is not None
        self._text.append(text)
        where = {
            "item_id": self._open["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
        }
        if kind == "reasoning":
            out.append(("response.reasoning_text.delta", {**where, "delta": text}))
        else:
            self._logprobs.extend(logprobs)
            out.append(
                ("response.output_text.delta", {**where, "delta": text, "logprobs": logprobs})
            )

    def _open_text(self, out: list[WireEvent], kind: str) -> None:
        if kind == "reasoning":
            item: dict[str, Any] = {
                "type": "reasoning",
                "id": new_id("rs"),
                "summary": [],
                "content": [],
                "encrypted_content": None,
                "status": "in_progress",
            }
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "type": "message",
                "id": new_id("msg"),
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open = item
        self._text = []
        self._logprobs = []
        self.items.append(item)
        index = len(self.items) - 1
        out.append(("response.output_item.added", {"output_index": index, "item": _copy(item)}))
        out.append(
            (
                "response.content_part.added",
                {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part},
            )
        )

    def _close(self, out: list[WireEvent], status: str) -> None:
        item = self._open
        if item is None:
            return
        if item["type"] == "function_call" or item["type"] == "custom_tool_call":
            self._end_call(out, "".join(self._text) or "{}", status)
            return
        self._open = None
        text = "".join(self._text)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if item["type"] == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": text}
            out.append(("response.reasoning_text.done", {**where, "text": text}))
        else:
            part = {
                "type": "output_text",
                "text": text,
                "annotations": [],
                "logprobs": self._logprobs,
            }
            out.append(
                ("response.output_text.done", {**where, "text": text, "logprobs": self._logprobs})
            )
        out.append(("response.content_part.done", {**where, "part": part}))
        item["content"] = [part]
        item["status"] = status
        out.append(
            (
                "response.output_item.done",
                {"output_index": where["output_index"], "item": _copy(item)},
            )
        )

    # -- calls -----------------------------------------------------------------------------
    def _open_call(self, out: list[WireEvent], start: ToolCallStart) -> None:
        target = self.targets.get(start.name, ToolTarget("function", start.name))
        if target.kind == "custom":
            item: dict[str, Any] = {
                "type": "custom_tool_call",
                "id": new_id("ctc"),
                "call_id": start.call_id,
                "name": target.name,
                "input": "",
                "status": "in_progress",
            }
        else:
            item = {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": start.call_id,
                "name": target.name,
                "arguments": "",
                "status": "in_progress",
            }
        if target.namespace is not None:
            item["namespace"] = target.namespace
        self._open = item
        self._text = []
        self.items.append(item)
        out.append(
            (
                "response.output_item.added",
                {"output_index": len(self.items) - 1, "item": _copy(item)},
            )
        )

    def _arguments_delta(self, out: list[WireEvent], text: str) -> None:
        item = self._open
        if item is None or not text:
            return
        self._text.append(text)
        if item["type"] == "function_call":
            out.append(
                (
                    "response.function_call_arguments.delta",
                    {"item_id": item["id"], "output_index": len(self.items) - 1, "delta": text},
                )
            )

    def _end_call(self, out: list[WireEvent], arguments: str, status: str = "completed") -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        index = len(self.items) - 1
        if item["type"] == "custom_tool_call":
            raw = custom_input(arguments)
            if raw:
                out.append(
                    (
                        "response.custom_tool_call_input.delta",
                        {"item_id": item["id"], "output_index": index, "delta": raw},
                    )
                )
            out.append(
                (
                    "response.custom_tool_call_input.done",
                    {"item_id": item["id"], "output_index": index, "input": raw},
                )
            )
            item["input"] = raw
        else:
            out.append(
                (
                    "response.function_call_arguments.done",
                    {
                        "item_id": item["id"],
                        "output_index": index,
                        "name": item["name"],
                        "arguments": arguments,
                    },
                )
            )
            item["arguments"] = arguments
        item["status"] = status
        out.append(("response.output_item.done", {"output_index": index, "item": _copy(item)}))


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))


def usage_object(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def response_object(
    request: ResponsesRequest,
    response_id: str,
    created_at: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    incomplete_details: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The §2.2 ``Response``: request settings echoed, ``store`` always false."""
    body = request.body
    params = request.generation.params
    reasoning: dict[str, Any] = body["reasoning"] if isinstance(body.get("reasoning"), dict) else {}
    text = dict(body["text"]) if isinstance(body.get("text"), dict) else {}
    text.setdefault("format", {"type": "text"})
    tool_choice = body.get("tool_choice")
    result: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "model": request.model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "tool_choice": tool_choice if tool_choice is not None else "auto",
        "tools": body.get("tools") if isinstance(body.get("tools"), list) else [],
        "instructions": body.get("instructions"),
        # the request's own values (the engine keeps float32: 0.3 would read 0.30000001...)
        "temperature": _echoed(body.get("temperature"), params.temperature),
        "top_p": _echoed(body.get("top_p"), params.top_p),
        "max_output_tokens": request.max_output_tokens,
        "previous_response_id": None,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "text": text,
        "truncation": "disabled",
        "incomplete_details": incomplete_details,
        "error": error,
        "metadata": body.get("metadata") or {},
        "store": False,
        "background": False,
        "top_logprobs": request.generation.num_top_logprobs,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "user": body.get("user"),
        "usage": usage,
    }
    return result


def _echoed(given: Any, used: float) -> float:
    """A sampling setting as the request gave it, when it did (a number); else the one used,
    rounded to float32's precision (7 significant digits) as it was stored."""
    if isinstance(given, (int, float)) and not isinstance(given, bool):
        return float(given)
    return float(f"{used:.7g}")
