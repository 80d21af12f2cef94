"""``OutputParser``: one choice's streamed text split into reasoning, content and tool calls.

The pipeline is reasoning first, tool calls second: the reasoning parser separates
``<think>...</think>`` text, and only the content that comes out of it is given to the tool
parser, so a tool call written inside a closed ``<think>`` block stays reasoning text. A call
start marker in reasoning that is never closed ends the reasoning there when a call follows
(the reasoning parser is given the tool parser's class for that; see ``reasoning.py``). With no
tool parser (or ``enable_tools=False``, used for ``tool_choice="none"`` and requests without
tools) content passes through untouched, markers and all.

``reasoning_started`` only means something with a reasoning parser: it tells it the prompt
already opened ``<think>``. Without one, all text is content (``<think>`` tags included).
``tools`` (the request's tool list, OpenAI or Anthropic shape) gives the tool parser the
parameter schemas it converts XML values by and tells real parameter tags from quoted ones.

A parser class may set ``needs_special_tokens = True``: its markers are special tokens (gpt-oss
harmony), which a detokenizer that skips special tokens would remove before the parser sees
them. ``needs_special_tokens(tool, reasoning)`` tells the server to keep them for a request; the
parser then removes every marker itself.

Guarantee: for any split of the same text into ``feed`` calls, the events concatenate to the
same reasoning, the same content and the same calls (names and argument JSON); only the
``call_id`` values differ between runs. Each returned list has adjacent content (and adjacent
reasoning, and one call's adjacent argument) deltas merged and no empty deltas. Nothing else
comes between a call's ``ToolCallStart`` and its ``ToolCallEnd`` (so an Anthropic ``tool_use``
block can stay open alone), and calls never overlap. Whitespace-only content next to tool calls
is dropped (see ``tool_parser.py``).
"""

from __future__ import annotations

from .events import (
    ContentDelta,
    OutputEvent,
    ParsedToolCall,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from .registry import REASONING_PARSERS, TOOL_PARSERS


def needs_special_tokens(tool_parser: str | None, reasoning_parser: str | None) -> bool:
    """Whether the text given to these parsers (the tool parser as the request enables it, None
    when off) must keep the tokenizer's special tokens: a parser reads markers that are special
    tokens (``needs_special_tokens``)."""
    classes = [
        TOOL_PARSERS.get(tool_parser) if tool_parser else None,
        REASONING_PARSERS.get(reasoning_parser) if reasoning_parser else None,
    ]
    return any(getattr(cls, "needs_special_tokens", False) for cls in classes)


class OutputParser:
    """Splits one choice's streamed text into reasoning, content and tool calls."""

    def __init__(
        self,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        *,
        tools: list[dict] | None = None,
        reasoning_started: bool = False,
        enable_tools: bool = True,
    ) -> None:
        if tool_parser is not None and tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_parser {tool_parser!r} is not one of {sorted(TOOL_PARSERS)}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser {reasoning_parser!r} is not one of {sorted(REASONING_PARSERS)}"
            )
        tool_class = TOOL_PARSERS[tool_parser] if tool_parser and enable_tools else None
        self._reasoning = (
            REASONING_PARSERS[reasoning_parser](reasoning_started, tool_class, tools)
            if reasoning_parser
            else None
        )
        self._tools = tool_class(tools) if tool_class else None
        # The text fed in must keep the special tokens (see ``needs_special_tokens``).
        self.needs_special_tokens = needs_special_tokens(
            tool_parser if tool_class else None, reasoning_parser
        )
        self._reasoning_parts: list[str] = []
        self._content_parts: list[str] = []
        self._calls: list[ParsedToolCall] = []
        self._started: dict[int, ToolCallStart] = {}
        self._finished = False
        self._call_open = False  # a call's start went out and its end not yet
        self._deferred: list[OutputEvent] = []  # reasoning held until the open call ends

    def feed(self, text: str) -> list[OutputEvent]:
        """Events for one detokenized delta (any split, even one character)."""
        if self._finished:
            raise RuntimeError("OutputParser.feed() called after finish()")
        pieces = self._reasoning.feed(text) if self._reasoning else [ContentDelta(text)]
        return self._route(pieces, final=False)

    def finish(self, cut: bool = False) -> list[OutputEvent]:
        """Events for the end of generation: held-back text flushed, open calls resolved.
        ``cut`` (max_tokens ended it): the text the tool parser still held — the start of a
        call that never became one (a partial marker, a head without its arguments) — is
        dropped, not content, as vLLM and SGLang do (so a forced call leaves no markup)."""
        if self._finished:
            return []
        self._finished = True
        pieces = self._reasoning.finish() if self._reasoning else []
        return self._route(pieces, final=True, cut=cut)

    def _route(
        self, pieces: list[OutputEvent], final: bool, cut: bool = False
    ) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        for piece in pieces:
            if isinstance(piece, ContentDelta) and self._tools is not None:
                produced = self._tools.feed(piece.text)
                self._note_calls(produced)
                events.extend(produced)
            elif isinstance(piece, ReasoningDelta) and self._call_open:
                # Reasoning the reasoning parser found while a call streams (its markers
                # inside the call's text) waits for the call's end: nothing comes between a
                # call's start and end (module doc).
                self._deferred.append(piece)
            else:
                events.append(piece)
            if self._deferred and not self._call_open:
                events.extend(self._deferred)
                self._deferred = []
        if final and self._tools is not None:
            produced = self._tools.finish()
            if cut:
                produced = [e for e in produced if not isinstance(e, ContentDelta)]
            self._note_calls(produced)
            events.extend(produced)
        if self._deferred and (final or not self._call_open):
            events.extend(self._deferred)
            self._deferred = []
        return self._record(events)

    def _note_calls(self, events: list[OutputEvent]) -> None:
        """Whether a call is open after ``events`` (its start seen, its end not yet)."""
        for event in events:
            if isinstance(event, ToolCallStart):
                self._call_open = True
            elif isinstance(event, ToolCallEnd):
                self._call_open = False

    def _record(self, events: list[OutputEvent]) -> list[OutputEvent]:
        merged: list[OutputEvent] = []
        for event in events:
            if isinstance(event, (ContentDelta, ReasoningDelta)):
                if not event.text:
                    continue
                parts = (
                    self._content_parts
                    if isinstance(event, ContentDelta)
                    else self._reasoning_parts
                )
                parts.append(event.text)
                if merged and type(merged[-1]) is type(event):
                    event = type(event)(merged.pop().text + event.text)  # type: ignore[union-attr]
            elif isinstance(event, ToolCallArgumentsDelta):
                if not event.text:
                    continue
                last = merged[-1] if merged else None
                if isinstance(last, ToolCallArgumentsDelta) and last.index == event.index:
                    merged.pop()
                    event = ToolCallArgumentsDelta(event.index, last.text + event.text)
            elif isinstance(event, ToolCallStart):
                self._started[event.index] = event
            elif isinstance(event, ToolCallEnd):
                start = self._started[event.index]
                self._calls.append(ParsedToolCall(start.call_id, start.name, event.arguments))
            merged.append(event)
        return merged

    @property
    def tool_calls(self) -> list[ParsedToolCall]:
        """Every completed call so far, in index order."""
        return list(self._calls)

    @property
    def reasoning_text(self) -> str:
        return "".join(self._reasoning_parts)

    @property
    def content_text(self) -> str:
        return "".join(self._content_parts)
