"""Parser events → Anthropic content blocks, as stream events and as the final ``content`` list.

This module owns the response side of ``/v1/messages`` (conformance §3.3, §3.4). One
:class:`BlockWriter` per message turns the :mod:`resin.server.parsers` events of the output into
``thinking`` / ``text`` / ``tool_use`` blocks. Streaming and non-streaming responses both go
through it, so they always carry the same blocks in the same order.

Block rules: indices are 0, 1, 2, ... in start order and only one block is open at a time — a
change of kind closes the open block first, so reasoning that comes back after text opens a new
thinking block. A thinking block gets a random ``signature`` (sent as ``signature_delta`` just
before its ``content_block_stop``). With ``thinking.display: "omitted"`` (``omit_thinking``)
thinking blocks are sent as Anthropic sends them then: the block with ``thinking: ""`` and its
signature, no ``thinking_delta`` events. Blocks carry none of the blank edges a model writes around
its markers: a thinking block starts at its first non-blank character and drops its trailing
whitespace; a text block drops its leading whitespace when another block precedes it and its
trailing whitespace when another block follows it (so the ``"\\n\\n"`` after ``</think>`` or
between tool calls is no block). Plain text output is kept exactly — the text equals
``resin.llm.LLM.chat``'s — and an output of nothing but whitespace is one text block. A
``tool_use`` block's ``input_json_delta`` fragments are the parser's argument fragments, which
concatenate to the JSON object; the final ``input`` is that object, or ``{}`` when it does not
decode to one.

Also here: ``stop_reason`` / ``stop_sequence`` from a finished choice, and the usage object
(``input_tokens`` excludes cache reads, which are ``cache_read_input_tokens``).
"""

from __future__ import annotations

import json
from typing import Any

from resin.server.generation import Usage
from resin.server.ids import random_id
from resin.server.parsers import (
    ContentDelta,
    OutputEvent,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from resin.server.sse import named_event


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def decode_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (json.JSONDecodeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


class BlockWriter:
    """Builds the content blocks of one message; :meth:`feed` and :meth:`finish` return the
    SSE events (``content_block_*``) for the events given; :meth:`content` is the final list."""

    def __init__(self, *, omit_thinking: bool = False) -> None:
        self.omit_thinking = omit_thinking  # thinking.display "omitted": blocks without text
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the last block of ``blocks`` while open
        self._open_call: int | None = None  # parser index of the open tool_use block
        self._pending_space = ""  # whitespace-only text not yet given a block
        self._held_space = ""  # trailing whitespace of the open thinking/text block

    @property
    def index(self) -> int:
        return len(self.blocks) - 1

    def feed(self, events: list[OutputEvent]) -> list[str]:
        out: list[str] = []
        for event in events:
            if isinstance(event, ReasoningDelta):
                self._thinking(event.text, out)
            elif isinstance(event, ContentDelta):
                self._text(event.text, out)
            elif isinstance(event, ToolCallStart):
                self._pending_space = ""
                self._start(
                    out,
                    {
                        "type": "tool_use",
                        "id": tool_use_id(event.call_id),
                        "name": event.name,
                        "input": {},
                        "_call": event.index,
                    },
                )
                self._open_call = event.index
            elif isinstance(event, ToolCallArgumentsDelta):
                if event.text and self._open_call == event.index:
                    out.append(
                        self._delta({"type": "input_json_delta", "partial_json": event.text})
                    )
            elif isinstance(event, ToolCallEnd):
                self._end_call(event, out)
        return out

    def finish(self) -> list[str]:
        """Close the open block; the output's final text keeps its trailing whitespace."""
        out: list[str] = []
        if self._pending_space and not self.blocks:
            self._start(out, {"type": "text", "text": ""})
            self._append(self._pending_space, out)
        self._pending_space = ""
        if self._open is not None and self._open["type"] == "text" and self._held_space:
            self._emit(self._held_space, out)
        self._close(out)
        return out

    # -- block kinds ----------------------------------------------------------------------------
    def _thinking(self, text: str, out: list[str]) -> None:
        if self._open is not None and self._open["type"] == "thinking":
            self._append(text, out)
        elif text.strip():  # a thinking block starts at its first non-blank character
            self._start(out, {"type": "thinking", "thinking": "", "signature": ""})
            self._append(text.lstrip(), out)

    def _text(self, text: str, out: list[str]) -> None:
        if self._open is not None and self._open["type"] == "text":
            self._append(text, out)
            return
        text = self._pending_space + text
        if not text.strip():
            self._pending_space = text
            return
        self._pending_space = ""
        self._start(out, {"type": "text", "text": ""})
        self._append(text.lstrip() if len(self.blocks) > 1 else text, out)

    def _append(self, text: str, out: list[str]) -> None:
        """Add text to the open thinking/text block, holding back trailing whitespace (dropped
        if another block follows)."""
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body) :]
        if body:
            self._emit(body, out)

    def _emit(self, text: str, out: list[str]) -> None:
        block = self._open
        assert block is not None
        if block["type"] == "thinking":
            if self.omit_thinking:
                return  # the block, its signature and its place stay; its text is not sent
            block["thinking"] += text
            out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        else:
            block["text"] += text
            out.append(self._delta({"type": "text_delta", "text": text}))

    def _end_call(self, event: ToolCallEnd, out: list[str]) -> None:
        for block in reversed(self.blocks):
            if block["type"] == "tool_use" and block["_call"] == event.index:
                block["input"] = decode_input(event.arguments)
                break
        if self._open_call == event.index:
            self._close(out)

    # -- block lifecycle --------------------------------------------------------------------------
    def _start(self, out: list[str], block: dict[str, Any]) -> None:
        self._close(out)
        self.blocks.append(block)
        self._open = block
        out.append(
            named_event(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": self.index,
                    "content_block": {k: v for k, v in block.items() if not k.startswith("_")},
                },
            )
        )

    def _delta(self, delta: dict[str, Any]) -> str:
        return named_event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index, "delta": delta},
        )

    def _close(self, out: list[str]) -> None:
        block = self._open
        if block is None:
            return
        if block["type"] == "thinking":
            block["signature"] = random_id("", 32)
            out.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        out.append(
            named_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        )
        self._open = None
        self._open_call = None
        self._held_space = ""

    def content(self) -> list[dict[str, Any]]:
        """The finished blocks, without bookkeeping keys."""
        return [{k: v for k, v in block.items() if not k.startswith("_")} for block in self.blocks]


def stop_reason(
    finish_reason: str | None, stop_string: str | None, num_tool_calls: int, clamped: bool = False
) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` for a finished choice. ``clamped``: the client's
    ``max_tokens`` did not fit and the context's room was used instead, so running out is
    ``model_context_window_exceeded``, not ``max_tokens`` (which Claude Code reports as "the
    response exceeded the N output token maximum")."""
    if finish_reason == "length":
        return ("model_context_window_exceeded" if clamped else "max_tokens"), None
    if stop_string is not None:  # before tool_use: a stop string can cut a call
        return "stop_sequence", stop_string
    if num_tool_calls:
        return "tool_use", None
    return "end_turn", None


def usage_body(usage: Usage) -> dict[str, Any]:
    cached = min(usage.cached_tokens, usage.prompt_tokens)
    return {
        "input_tokens": usage.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage.completion_tokens,
    }
