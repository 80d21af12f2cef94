"""gpt-oss "harmony" output: reasoning parser ``openai_gptoss``, tool parser ``openai``.

gpt-oss writes its turn as a sequence of messages, each a header and a body (the prompt ends
with ``<|start|>assistant``, so the first message has no ``<|start|>``)::

    <|channel|>analysis<|message|>Oslo, two days.<|end|>
    <|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>

or, for an answer, ``<|start|>assistant<|channel|>final<|message|>...<|return|>``. The markers are
special tokens: the server keeps them in the text for these parsers (``needs_special_tokens``;
``resin.server.chat_output``), and the parsers remove every one of them. ``<|return|>`` and
``<|call|>`` are stop tokens, left out of the text, so a turn's text usually ends right after
its last body.

What a message becomes, by its header (the words between ``<|start|>`` or the output's start
and ``<|message|>``: the role, ``<|channel|>`` and the channel, a recipient ``to=...`` before or
after the channel, a content type such as ``json`` or ``<|constrain|>json``):

* a recipient ``functions.NAME`` (or the bare name of a declared tool): a tool call. The body,
  a JSON object, streams as the call's arguments (``json_stream.JsonObjectStreamer``), and the
  call ends where the object closes (so a call the stop token ``<|call|>`` ends is complete
  before the generation's end). Arguments that turn invalid end the call with their valid
  part; the rest of the body is content. A body that is not an object is content. An empty
  body is a call with ``{}``. With tool parsing off (``tool_choice: "none"``, no tools) the
  call is dropped, as vLLM drops it.
* any other recipient (the built-in tools ``browser.*``, ``python``, ``container.*``, or a
  hallucinated tool output addressed ``to=assistant``): dropped. The server runs no built-in
  tools; their bodies are neither the answer nor a function call.
* channel ``analysis``: reasoning (content under the tool parser alone: no reasoning split).
* anything else (``final``, a ``commentary`` preamble, no or an unknown channel): content.

A body ends at ``<|end|>``, ``<|return|>``, ``<|call|>``, the next ``<|start|>`` or
``<|channel|>`` (a missing ``<|end|><|start|>assistant``), or the end of the text;
``<|message|>`` / ``<|constrain|>`` inside a body are dropped. Between messages, whitespace
and stray end markers are dropped, and other text is content (its own message).

Malformed output falls back to content, markers removed: a header that holds a newline or runs
past ``HEADER_MAX`` characters before its ``<|message|>`` was not one: its text (markers
removed) is content, as is what follows up to the next marker. A header the output ends in, or that a ``<|start|>`` or an end marker cuts off, is
dropped: it has no body. Output without any marker (not harmony at all) is content.

The two parsers chain as the server chains any pair (``OutputParser``): ``openai_gptoss``
takes the reasoning out and hands every other message on to ``openai`` *with its markers*,
along with the end markers of the reasoning messages (so both parsers agree on where each
message ends); ``openai`` reads those into content and calls. ``openai_gptoss`` chained with no
tool parser (or another one) gives plain content itself. Every decision depends on the text
seen so far only, never on how it was split into deltas.
"""

from __future__ import annotations

from .events import ContentDelta, OutputEvent, ReasoningDelta
from .holdback import find_first, partial_tail
from .json_stream import JsonObjectStreamer
from .tool_parser import ToolParser, is_function_name

START, CHANNEL, CONSTRAIN, MESSAGE = "<|start|>", "<|channel|>", "<|constrain|>", "<|message|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
MARKERS = (START, CHANNEL, CONSTRAIN, MESSAGE, END, RETURN, CALL)
TERMINATORS = (END, RETURN, CALL)
HEADER_MAX = 512  # characters of a header, markers left out ("functions." + a 256-char name ...)
FUNCTIONS = "functions."
RECIPIENT = "to="


def parse_header(raw: str) -> tuple[str | None, str | None]:
    """``(channel, recipient)`` of a header's raw text, markers included; None when absent."""
    text = raw.replace(START, " ").replace(MESSAGE, " ").replace(CONSTRAIN, " ")
    before, sep, after = text.partition(CHANNEL)
    after = after.replace(CHANNEL, " ")
    words = before.split() + after.split()
    recipient = next((w[len(RECIPIENT) :] for w in words if w.startswith(RECIPIENT)), None)
    channel = next((w for w in after.split() if not w.startswith(RECIPIENT)), None)
    return (channel if sep else None), (recipient or None)


def strip_markers(text: str) -> str:
    for marker in MARKERS:
        text = text.replace(marker, "")
    return text


class HarmonyParser(ToolParser):
    """The harmony state machine (states ``between``, ``header``, ``body``) under one of three
    setups: tool parser (``openai``: calls made, analysis is content), reasoning parser alone
    (analysis is reasoning, calls dropped) or reasoning parser before ``openai`` (analysis is
    reasoning, everything else handed on raw as content, ``forward``)."""

    needs_special_tokens = True  # the markers are special tokens: keep them in the text
    reasoning_exit_markers = ()  # never ends a <think> block's reasoning (another parser's)
    initial_state = "between"

    def __init__(
        self,
        tools: list[dict] | None = None,
        *,
        analysis_is_reasoning: bool = False,
        calls: bool = True,
        forward: bool = False,
    ) -> None:
        super().__init__(tools)
        self._analysis_is_reasoning = analysis_is_reasoning
        self._calls = calls
        self._forward = forward
        self._header = ""  # raw text of the header being read, markers included
        self._header_len = 0  # its length without markers
        self._kind = "content"  # the body being read: content, reasoning, call or drop
        self._handed_on = True  # forward: the body being read goes on raw (not reasoning)
        self._call_name = ""
        self._call_state = "wait"  # wait (no "{" yet), args (streaming), after (object closed)

    def in_plain_content(self) -> bool:
        return self.num_calls == 0 and self._kind == "content"

    # -- output ------------------------------------------------------------------------------

    def _hand_on(self, out: list[OutputEvent], raw: str) -> None:
        """Forward mode: raw text (markers included) for the tool parser that follows."""
        if self._forward and raw:
            out.append(ContentDelta(raw))

    def _text(self, out: list[OutputEvent], text: str) -> None:
        """Content of the output (not in forward mode)."""
        if not text:
            return
        if self._calls:
            self._content(out, text)  # whitespace around calls handled as by every tool parser
        else:
            out.append(ContentDelta(text))

    # -- states ------------------------------------------------------------------------------

    def _step_between(self, out: list[OutputEvent], final: bool) -> bool:
        buf = self._buf
        rest = buf.lstrip()
        if not rest:
            if final:
                self._hand_on(out, buf)
                self._buf = ""
            return False
        space = buf[: len(buf) - len(rest)]
        for marker in MARKERS:
            if rest.startswith(marker):
                self._buf = rest[len(marker) :]
                if marker in (START, CHANNEL):  # handed on with the header, if at all
                    self._hand_on(out, space)
                    self._open_header(marker)
                    return True
                self._hand_on(out, space + marker)
                if marker == MESSAGE:  # a body without a header
                    self._open_body(out, "")
                return True  # an end marker or <|constrain|> between messages: dropped
        if not final and (any(m.startswith(rest) for m in MARKERS) or RECIPIENT.startswith(rest)):
            return False  # a marker or "to=" may be arriving
        self._hand_on(out, space)
        self._buf = rest
        if rest.startswith(RECIPIENT):  # " to=functions.f<|channel|>...": a header
            self._open_header("")
        else:  # text outside any message: content
            self._begin_body("content", handed_on=True)
        return True

    def _open_header(self, marker: str) -> None:
        self._header, self._header_len = marker, 0
        self._state = "header"

    def _step_header(self, out: list[OutputEvent], final: bool) -> bool:
        buf = self._buf
        at, marker = find_first(buf, MARKERS)
        if at == -1:
            at = len(buf) if final else len(buf) - partial_tail(buf, MARKERS)
        segment = buf[:at]
        newline = segment.find("\n")
        if newline != -1 or self._header_len + len(segment) > HEADER_MAX:
            # Not a header: its text is content, and so is what follows up to a marker.
            raw = self._header
            self._hand_on(out, raw)
            self._begin_body("content", handed_on=True)
            if not self._forward:
                self._text(out, strip_markers(raw))
            return True
        if not marker:
            if final:  # the output ends inside a header: no body, dropped
                self._hand_on(out, self._header + buf)
                self._buf, self._header = "", ""
                self._state = "between"
            return False
        self._header += segment + marker
        self._header_len += len(segment)
        self._buf = buf[at + len(marker) :]
        if marker in (CHANNEL, CONSTRAIN):
            return True
        if marker == MESSAGE:
            self._open_body(out, self._header)
            return True
        # <|start|> or an end marker before <|message|>: the header had no body; dropped.
        if marker == START:
            self._hand_on(out, self._header[: -len(START)])
            self._open_header(START)
        else:
            self._hand_on(out, self._header)
            self._state = "between"
        return True

    def _open_body(self, out: list[OutputEvent], header: str) -> None:
        """A header is complete (``header`` raw, "" for a bare ``<|message|>``)."""
        channel, recipient = parse_header(header)
        if recipient is not None:
            name = recipient[len(FUNCTIONS) :] if recipient.startswith(FUNCTIONS) else recipient
            is_call = (recipient.startswith(FUNCTIONS) or name in self.schemas) and (
                is_function_name(name, self.schemas)
            )
            kind = "call" if is_call else "drop"
            self._call_name = name
        elif channel == "analysis":
            kind = "reasoning"
        else:
            kind = "content"
        handed_on = kind != "reasoning" or not self._analysis_is_reasoning
        if handed_on:
            self._hand_on(out, header)
        self._begin_body(kind, handed_on)

    def _begin_body(self, kind: str, handed_on: bool) -> None:
        self._header, self._header_len = "", 0
        if kind == "call" and not self._calls:
            kind = "drop"
        self._kind, self._handed_on = kind, handed_on
        self._call_state = "wait"
        self._state = "body"

    def _step_body(self, out: list[OutputEvent], final: bool) -> bool:
        buf = self._buf
        at, marker = find_first(buf, MARKERS)
        if at == -1:
            at = len(buf) if final else len(buf) - partial_tail(buf, MARKERS)
        self._body(out, buf[:at])
        self._buf = buf[at + len(marker) :]
        if not marker:
            if final:
                self._end_body(out)
                self._state = "between"
            return False
        if marker in (MESSAGE, CONSTRAIN):  # no place in a body: dropped
            if self._handed_on:
                self._hand_on(out, marker)
            return True
        self._end_body(out)
        if marker in TERMINATORS:
            self._hand_on(out, marker)  # a reasoning message's end too: see the module doc
            self._state = "between"
        else:  # <|start|> or <|channel|>: the next message, without an end marker
            self._open_header(marker)
        return True

    # -- bodies ------------------------------------------------------------------------------

    def _body(self, out: list[OutputEvent], text: str) -> None:
        if not text:
            return
        if self._forward:
            if self._handed_on:
                out.append(ContentDelta(text))
            else:
                out.append(ReasoningDelta(text))
        elif self._kind == "reasoning" and self._analysis_is_reasoning:
            out.append(ReasoningDelta(text))
        elif self._kind in ("content", "reasoning"):
            self._text(out, text)
        elif self._kind == "call":
            self._call_body(out, text)

    def _call_body(self, out: list[OutputEvent], text: str) -> None:
        if self._call_state == "wait":
            rest = text.lstrip()
            if not rest:
                return  # leading whitespace of the arguments
            if rest[0] != "{":  # not a JSON object: the body is content
                self._kind = "content"
                self._text(out, rest)
                return
            self._start_call(out, self._call_name)
            self._streamer = JsonObjectStreamer()
            self._call_state = "args"
            text = rest
        if self._call_state == "args":
            piece, used = self._streamer.feed(text)
            self._args(out, piece)
            if not (self._streamer.done or self._streamer.error):
                return
            self._args(out, self._streamer.close())
            self._end_call(out, cut=self._streamer.error)
            self._call_state = "after"
            text = text[used:]
        self._text(out, text)  # after the object: content (whitespace dropped next to calls)

    def _end_body(self, out: list[OutputEvent]) -> None:
        if self._forward or self._kind != "call":
            return
        if self._call_state == "wait":  # an empty body: a call without arguments
            self._start_call(out, self._call_name)
            self._args(out, "{}")
            self._end_call(out)
        elif self._call_state == "args":  # cut off: the valid part
            self._args(out, self._streamer.close())
            self._end_call(out)
        self._call_state = "after"


class HarmonyToolParser(HarmonyParser):
    """``openai``: calls from ``to=functions.NAME`` messages; every other message's text is
    content (reasoning too, when no ``openai_gptoss`` parser took it out first)."""


class HarmonyReasoningParser:
    """``openai_gptoss``: ``analysis`` messages are reasoning. Before a harmony tool parser the
    rest goes on to it raw; otherwise content is given plain and calls are dropped.
    ``reasoning_started`` has no meaning for harmony (the channel says what a message is)."""

    needs_special_tokens = True

    def __init__(
        self,
        reasoning_started: bool = False,
        tool_parser: type[ToolParser] | None = None,
        tools: list[dict] | None = None,
    ) -> None:
        forward = tool_parser is not None and issubclass(tool_parser, HarmonyParser)
        self._parser = HarmonyParser(
            tools, analysis_is_reasoning=True, calls=False, forward=forward
        )

    def feed(self, text: str) -> list[OutputEvent]:
        return self._parser.feed(text)

    def finish(self) -> list[OutputEvent]:
        return self._parser.finish()
