"""Events one choice's output parser emits, and the record of a finished tool call.

The server turns these into wire chunks: ``ContentDelta`` -> ``delta.content`` / ``text_delta``,
``ReasoningDelta`` -> ``reasoning_content`` / ``thinking_delta``, the three ``ToolCall*`` events
-> ``delta.tool_calls[i]`` fragments / a ``tool_use`` block with ``input_json_delta``.

Guarantees (held by every parser in this package): for one choice, ``ToolCallStart`` comes once
per call with ``index`` 0, 1, 2, ... in order; every ``ToolCallArgumentsDelta`` of that index
comes after its start and before its ``ToolCallEnd``; the deltas' texts concatenate to exactly
``ToolCallEnd.arguments``, which is a JSON object (``"{}"`` when the call has no arguments).
"""

from __future__ import annotations

from dataclasses import dataclass

from resin.server.ids import random_id


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    call_id: str  # "call_" + 24 hex digits
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallArgumentsDelta:
    index: int
    text: str  # a fragment of the JSON-encoded arguments


@dataclass(frozen=True, slots=True)
class ToolCallEnd:
    index: int
    arguments: str  # the whole JSON-encoded arguments object
    # Not a call the model finished: the generation ended inside it (max tokens, a stop string,
    # EOS; set by ``ChatChoice``) or its arguments turned invalid (set by the parser), and the
    # parser closed what it had. Such a call is never reported as finished (finish_reason
    # "tool_calls", stop_reason "tool_use", a "completed" item): a client would run it.
    cut: bool = False


OutputEvent = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    call_id: str
    name: str
    arguments: str  # JSON-encoded object


def new_call_id() -> str:
    return random_id("call_")
