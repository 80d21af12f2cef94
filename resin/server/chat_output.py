"""One chat choice's output: generated text → reasoning, content and tool calls, for any API.

``ChatChoice`` wraps a :class:`resin.server.parsers.OutputParser` (tool parser and reasoning
parser chosen by ``--tool-parser`` / ``--reasoning-parser``, defaulted from the model type) and
accumulates what the non-streaming responses need: the content, the reasoning, the completed
tool calls, the finish reason and logprobs. Streaming adapters take the events of each
:class:`ChoiceDelta` from :meth:`ChatChoice.events`; non-streaming ones read the totals.

``tool_choice`` rules: ``"none"`` (or no tools) turns tool parsing off — markers stay text;
``"auto"``, ``"required"`` and a named function parse tool calls; ``"required"`` and a named
function are also forced with a grammar where the runner can (:mod:`resin.server.structured`). ``finish_reason`` becomes
``"tool_calls"`` when at least one call was parsed and generation stopped normally, except for a
named function: ``"stop"`` there, as OpenAI (and vLLM) answer a forced named call.

:func:`skip_special_tokens` decides whether a request's text keeps the tokenizer's special
tokens: it must when the choice's parsers read markers that are special tokens (gpt-oss
harmony), whatever the request's ``skip_special_tokens`` says; the parsers remove them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from resin.server.chat_prompt import ChatPrompt
from resin.server.context import ServerContext
from resin.server.errors import APIError
from resin.server.generation import ChoiceDelta, TokenLogprob
from resin.server.parsers import (
    OutputEvent,
    OutputParser,
    ParsedToolCall,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    needs_special_tokens,
)


def parse_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    """``none`` / ``auto`` / ``required``, ``{"type": "function", "name": ...}``, or for
    ``allowed_tools`` with mode ``required`` ``{"type": "allowed_tools", "names": [...]}`` (a
    forced call of one of them; mode ``auto`` is ``auto``)."""
    if isinstance(value, dict) and value.get("type") == "allowed_tools":
        allowed = value.get("allowed_tools")  # Chat nests them; Responses does not
        spec = allowed if isinstance(allowed, dict) else value
        return allowed_tools_choice(spec.get("mode"), spec.get("tools"), tools)
    if value is None:
        return "auto" if tools else "none"
    if value == "required" and not tools:
        raise APIError(400, "tool_choice 'required' needs at least one tool", param="tool_choice")
    if value in ("none", "auto", "required"):
        return str(value)
    if isinstance(value, dict):
        name = value.get("name")
        if name is None and isinstance(value.get("function"), dict):
            name = value["function"].get("name")
        if isinstance(name, str):
            if not any(t["function"]["name"] == name for t in tools or ()):
                raise APIError(
                    400,
                    f"tool_choice names function {name!r}, which is not in 'tools'",
                    param="tool_choice",
                )
            return {"type": "function", "name": name}
    raise APIError(
        400,
        "'tool_choice' must be 'none', 'auto', 'required' or a named function",
        param="tool_choice",
    )


def allowed_tools_choice(
    mode: Any, allowed: Any, tools: list[dict[str, Any]] | None
) -> str | dict[str, Any]:
    """OpenAI's ``allowed_tools`` (``mode`` ``auto`` or ``required``; ``allowed`` a list of
    ``{"type": "function", "name"}`` or Chat's ``{"type": "function", "function": {"name"}}``):
    ``required`` is a forced call of one of those tools (the prompt still lists them all),
    ``auto`` lets the model call a tool. A name not in ``tools`` is a 400."""
    if mode not in ("auto", "required") or not isinstance(allowed, list) or not allowed:
        raise APIError(
            400,
            "tool_choice allowed_tools needs 'mode' ('auto' or 'required') and a non-empty "
            "'tools' list",
            param="tool_choice",
        )
    offered = {t["function"]["name"] for t in tools or ()}
    names = []
    for entry in allowed:
        function = entry.get("function") if isinstance(entry, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if name is None and isinstance(entry, dict):
            name = entry.get("name")
        if not isinstance(name, str) or name not in offered:
            raise APIError(
                400,
                f"tool_choice allowed_tools lists {name!r}, which is not in 'tools'",
                param="tool_choice",
            )
        names.append(name)
    if mode == "auto":
        return "auto"
    return {"type": "allowed_tools", "names": names}


def _parsers(
    ctx: ServerContext, prompt: ChatPrompt, tool_choice: Any
) -> tuple[str | None, str | None]:
    """The (tool parser, reasoning parser) one choice of this request runs; None when off."""
    enable_tools = bool(prompt.tools) and tool_choice != "none"
    return (
        ctx.options.tool_parser if enable_tools else None,
        None if prompt.reasoning_closed else ctx.options.reasoning_parser,
    )


def skip_special_tokens(
    ctx: ServerContext, prompt: ChatPrompt, tool_choice: Any, requested: bool = True
) -> bool:
    """The ``skip_special_tokens`` of the request's detokenizer: ``requested`` (the request's
    field, default True), unless the parsers need the special tokens (``needs_special_tokens``)."""
    return requested and not needs_special_tokens(*_parsers(ctx, prompt, tool_choice))


class ChatChoice:
    """Parser and totals of one choice."""

    def __init__(self, ctx: ServerContext, prompt: ChatPrompt, tool_choice: Any) -> None:
        tool_parser, reasoning_parser = _parsers(ctx, prompt, tool_choice)
        self.parser = OutputParser(
            tool_parser,
            reasoning_parser,
            tools=prompt.tools,
            reasoning_started=prompt.reasoning_started,
            enable_tools=tool_parser is not None,
        )
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        self.logprobs: list[TokenLogprob] = []
        self.num_tool_calls = 0  # calls the model finished
        self.num_cut_tool_calls = 0  # calls the end of the generation cut (closed by the parser)
        self._open_calls: set[int] = set()  # calls started and not yet ended, by index
        self.max_tool_calls = prompt.max_tool_calls  # None, or 1: no parallel calls
        # OpenAI ends a call forced by name with "stop", not "tool_calls"
        self.named_tool_choice = (
            isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
        )

    def events(self, delta: ChoiceDelta) -> list[OutputEvent]:
        events = self.parser.feed(delta.text) if delta.text else []
        if delta.finish_reason is not None:
            finishing = self.parser.finish(cut=delta.finish_reason == "length")
        else:
            finishing = []
        if self.max_tool_calls is not None:  # calls past the allowed number are dropped
            events = [e for e in events if not self._dropped(e)]
            finishing = [e for e in finishing if not self._dropped(e)]
        for event in events:
            if isinstance(event, ToolCallStart):
                self._open_calls.add(event.index)
            elif isinstance(event, ToolCallEnd):
                self._open_calls.discard(event.index)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            # A call that was streaming when the generation ended was cut: the parser closes
            # what it had. (A call held back whole until the end, as text inside an unclosed
            # reasoning block is, comes out of finish() complete: not marked.)
            events.extend(
                replace(e, cut=True)
                if isinstance(e, ToolCallEnd) and e.index in self._open_calls
                else e
                for e in finishing
            )
            self.stop_string = delta.stop_string
            self.finish_reason = delta.finish_reason
        self.num_tool_calls += sum(1 for e in events if isinstance(e, ToolCallEnd) and not e.cut)
        self.num_cut_tool_calls += sum(1 for e in events if isinstance(e, ToolCallEnd) and e.cut)
        if (
            delta.finish_reason == "stop"
            and self.num_tool_calls
            and not self.num_cut_tool_calls
            and delta.stop_string is None
            and not self.named_tool_choice
        ):
            self.finish_reason = "tool_calls"
        return events

    def _dropped(self, event: OutputEvent) -> bool:
        calls = (ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd)
        limit = self.max_tool_calls
        return limit is not None and isinstance(event, calls) and event.index >= limit

    @property
    def tool_calls(self) -> list[ParsedToolCall]:
        """The calls the choice reports (the first ``max_tool_calls`` of those parsed)."""
        calls = self.parser.tool_calls
        return calls if self.max_tool_calls is None else calls[: self.max_tool_calls]

    @property
    def content(self) -> str:
        return self.parser.content_text

    @property
    def reasoning(self) -> str:
        return self.parser.reasoning_text
