"""The base every tool-call parser builds on: content scanning, call bookkeeping, event emission.

A tool parser sees the content part of one choice's text (reasoning already split off) as a
stream of deltas and turns it into ``ContentDelta`` and ``ToolCall*`` events. It is a small state
machine: the ``content`` state looks for the format's start markers (holding back a possible
partial marker, so none leaks into content), and each subclass adds the states that read a call
body. ``feed`` runs the steps until one has to wait for more text; ``finish`` runs them in *final*
mode, where no state may wait: an unterminated call is completed if it can be, else its raw text
goes out as content.

Because every decision depends only on the text seen so far (never on how it was split), any
chunking of the same text gives the same content and the same calls.

Whitespace: trailing whitespace of content is held until more content follows. It is dropped
when a tool call starts right after it, and at the end once any call was made (vLLM likewise
drops the blank lines around calls); with no calls it is released at the end.

Names: a call is made only for a name that can be a function name (``is_function_name``): a
template that leaked unrendered (``<function={{ tc.name }}>``) or prose is text, not a call.
Arguments: a parameter written twice in one call (XML formats) keeps its first value, so the
streamed arguments never hold a duplicated key. String parameters of the XML formats stream
as their text arrives (``_open_string_param`` ...), other parameters when complete.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .events import (
    ContentDelta,
    OutputEvent,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    new_call_id,
)
from .holdback import split_at_marker
from .json_stream import JsonObjectStreamer
from .schema import ToolSchemas, is_plain_string, tool_schemas

JSON_BODY_END = "</tool_call>"
# The start of a hermes body up to its arguments object: what lets the arguments stream.
HERMES_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\<\n]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)


# Characters no function name has; vLLM's qwen3_coder parser refuses the same set.
_NOT_IN_NAMES = frozenset("{}<>()[]\"'`\\,;=")
MAX_NAME = 256


def is_function_name(name: str, schemas: ToolSchemas | None = None) -> bool:
    """Whether ``name`` (already stripped) can name a function: one of the request's tools, or
    a non-empty word with no whitespace and none of ``{}<>()[]"'`\\,;=`` (letters of any script,
    digits, ``_ - . : /`` are fine: ``get_weather``, ``mcp.fs/read``, ``ns__tool``)."""
    if schemas and name in schemas:
        return True
    return 0 < len(name) <= MAX_NAME and not any(c.isspace() or c in _NOT_IN_NAMES for c in name)


def could_be_function_name(prefix: str, schemas: ToolSchemas | None = None) -> bool:
    """Whether more text can still make ``prefix`` (a name arriving, surrounding whitespace
    allowed) a function name: lets a parser reject prose at once instead of at the next ``>``."""
    name = prefix.strip()
    if len(prefix) > 2 * MAX_NAME:
        return False
    if not name or (schemas and any(tool.startswith(name) for tool in schemas)):
        return True
    return is_function_name(name, schemas)


def call_from_json(
    obj: Any, args_keys: tuple[str, ...], schemas: ToolSchemas | None = None
) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` from a decoded ``{"name": ..., "arguments": {...}}`` object.

    The arguments may sit under any of ``args_keys``, be absent (``{}``) or be a JSON string that
    holds an object. Anything else (no string name, arguments not an object) is ``None``.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not is_function_name(name.strip(), schemas):
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if args is None:
        args = {}
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    # A lone "\\ud83d" escape decodes to half a character: U+FFFD instead (a client sending
    # the call back would otherwise have its turn refused).
    return name.strip(), _LONE_SURROGATE.sub("\ufffd", json.dumps(args, ensure_ascii=False))


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _ends_in_string(body: str) -> bool:
    """Whether a JSON object's text so far ends inside one of its strings."""
    streamer = JsonObjectStreamer()
    streamer.feed(body.lstrip())
    return streamer.in_string


def parse_json_calls(body: str, schemas: ToolSchemas | None = None) -> list[tuple[str, str]] | None:
    """``[(name, arguments JSON)]`` for a hermes-style body: one call object or a list of them;
    ``None`` when the body is not that (bad JSON, no function name, arguments not an object)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_from_json(item, ("arguments", "parameters"), schemas) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


class ToolParser:
    """Base class: subclasses set ``start_markers`` (and ``drop_markers``), implement
    ``_open_call(marker)`` to enter their first call state and one ``_step_<state>`` method per
    state. A step returns True when it changed something and the loop should run again."""

    start_markers: tuple[str, ...] = ()
    drop_markers: tuple[str, ...] = ()  # removed from content, start nothing
    # Markers that, met inside reasoning the model never closed, may end it there (see
    # ``reasoning.py``); None means ``start_markers``.
    reasoning_exit_markers: tuple[str, ...] | None = None
    # Streamed JSON calls (state "json_head"): a call body that matches one of ``json_heads``
    # (group "name") right up to its arguments object streams those arguments; any other body
    # is read whole up to ``call_end`` by ``buffered_state``.
    json_heads: tuple[re.Pattern[str], ...] = (HERMES_HEAD,)
    call_end = JSON_BODY_END
    buffered_state = "json_body"
    initial_state = "content"

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.schemas: ToolSchemas = tool_schemas(tools)
        self._buf = ""  # text received, not yet consumed by a state
        self._state = self.initial_state
        self._pending_ws = ""  # trailing whitespace of content, held (see module doc)
        self._raw = ""  # raw text of the call being read, for the fallback to content
        self.num_calls = 0
        self._args_parts: list[str] = []
        self._num_params = 0
        self._scan_from = 0  # the buffer before this offset holds no whole ``_find`` marker
        self._streamer = JsonObjectStreamer()  # the arguments being streamed (state json_stream)
        self._leftover = ""  # text after the streamed arguments turned invalid
        self._seen_keys: set[str] = set()  # parameters of the current call (XML formats)
        self._skip_param = False  # the parameter being read repeats one: dropped

    @classmethod
    def exit_markers(cls) -> tuple[str, ...]:
        return (
            cls.start_markers if cls.reasoning_exit_markers is None else cls.reasoning_exit_markers
        )

    def in_plain_content(self) -> bool:
        """No call made and none being read: everything consumed so far went out as content."""
        return self._state == "content" and self.num_calls == 0

    def held_back(self) -> int:
        """How many characters received last are not consumed yet (a possible partial marker)."""
        return len(self._buf)

    # -- driving -----------------------------------------------------------------------------

    def feed(self, text: str) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        self._buf += text
        while getattr(self, "_step_" + self._state)(out, False):
            pass
        return out

    def finish(self) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        while getattr(self, "_step_" + self._state)(out, True):
            pass
        self._at_finish(out)
        if self._pending_ws and self.num_calls == 0:
            out.append(ContentDelta(self._pending_ws))
        self._pending_ws = ""
        return out

    # -- content -----------------------------------------------------------------------------

    def _step_content(self, out: list[OutputEvent], final: bool) -> bool:
        before, marker, after = split_at_marker(self._buf, self.start_markers + self.drop_markers)
        if marker is None:
            self._content(out, self._buf if final else before)
            self._buf = "" if final else after
            return False
        self._content(out, before)
        self._buf = after
        self._scan_from = 0
        if marker not in self.drop_markers:
            self._raw = marker
            self._open_call(marker)
        return True

    def _open_call(self, marker: str) -> None:
        raise NotImplementedError

    def _at_finish(self, out: list[OutputEvent]) -> None:
        """Hook: release anything a subclass still holds once every state has finished."""

    def _find(self, marker: str) -> int:
        """``self._buf.find(marker)``, resuming where the last miss left off.

        A call body can be long (a file written through a tool) and arrives a few characters
        per delta; searching only the new tail keeps a whole body O(length), not O(length^2).
        Only valid while the buffer is appended to, so every hit resets the resume point.
        """
        at = self._buf.find(marker, max(0, self._scan_from - len(marker) + 1))
        self._scan_from = 0 if at != -1 else len(self._buf)
        return at

    def _content(self, out: list[OutputEvent], text: str) -> None:
        text = self._pending_ws + text
        body = text.rstrip()
        if body:
            out.append(ContentDelta(body))
        self._pending_ws = text[len(body) :]

    def _fallback(self, out: list[OutputEvent], rest: str = "") -> bool:
        """Give up on the call being read: its raw text (plus ``rest``) becomes content."""
        self._content(out, self._raw + rest)
        self._raw = ""
        self._state = "content"
        return True

    # -- calls -------------------------------------------------------------------------------

    def _start_call(self, out: list[OutputEvent], name: str) -> None:
        self._pending_ws = ""
        out.append(ToolCallStart(self.num_calls, new_call_id(), name))
        self.num_calls += 1
        self._args_parts = []
        self._num_params = 0
        self._seen_keys = set()
        self._raw = ""

    def _args(self, out: list[OutputEvent], text: str) -> None:
        if not text:
            return
        self._args_parts.append(text)
        out.append(ToolCallArgumentsDelta(self.num_calls - 1, text))

    def _end_call(self, out: list[OutputEvent], cut: bool = False) -> None:
        """The call ends; ``cut``: with the valid part of arguments that turned invalid."""
        out.append(ToolCallEnd(self.num_calls - 1, "".join(self._args_parts), cut))
        self._args_parts = []

    def _step_json_head(self, out: list[OutputEvent], final: bool) -> bool:
        """Start of a JSON call body: stream it if its head matches, else read it whole.

        A head cannot contain ``<``, so it ends before ``call_end``: once ``call_end`` has
        arrived without a match, no more text can make one (the choice is split-independent).
        """
        stripped = self._buf.lstrip()
        if self.call_end == JSON_BODY_END and stripped and stripped[0] not in "{[":
            return self._fallback(out)  # not JSON (say, prose naming the tag): content at once
        for head in self.json_heads:
            match = head.match(self._buf)
            if match and is_function_name(match.group("name").strip(), self.schemas):
                self._buf = self._buf[match.end() :]
                self._scan_from = 0
                self._start_call(out, match.group("name").strip())
                self._streamer = JsonObjectStreamer()
                self._leftover = ""
                self._state = "json_stream"
                return True
        if final or self._find(self.call_end) != -1:
            self._scan_from = 0
            self._state = self.buffered_state
            return True
        return False

    def _step_json_stream(self, out: list[OutputEvent], final: bool) -> bool:
        """The arguments object, released as it validates (``JsonObjectStreamer``), up to
        ``call_end`` — one met inside a string value is that string's text (a file the call
        writes may hold the tag). Text after the object (the outer ``}``, a code fence) is
        dropped; text from an invalid character on goes out as content after the call, which
        ends with the valid part of its arguments."""
        streamer = self._streamer
        while True:
            before, marker, after = split_at_marker(self._buf, (self.call_end,))
            if marker is None and final:
                before, after = self._buf, ""
            self._buf = after
            self._feed_arguments(out, before)
            if marker is None or not streamer.in_string:
                break
            self._args(out, streamer.feed(marker)[0])
        if marker is None and not final:
            return False
        self._args(out, streamer.close())
        self._end_call(out, cut=streamer.error)  # not the call the model wrote: not finished
        self._content(out, self._leftover)
        self._state = "content"
        return True

    def _feed_arguments(self, out: list[OutputEvent], text: str) -> None:
        """``text`` into the streamed arguments object: what validates is released, what
        follows an invalid character is kept (``_leftover``) to go out as content."""
        streamer = self._streamer
        if text and streamer.error:
            self._leftover += text
        elif text and not streamer.done:
            released, used = streamer.feed(text)
            self._args(out, released)
            if streamer.error:
                self._leftover += text[used:]

    def _step_json_body(self, out: list[OutputEvent], final: bool) -> bool:
        """A JSON call body up to ``</tool_call>`` (hermes, and models of the XML formats that
        fall back to it): decoded whole, or given back as raw content."""
        at = self._find(JSON_BODY_END)
        while at != -1 and _ends_in_string(self._buf[:at]):  # the tag is a string's text
            at = self._buf.find(JSON_BODY_END, at + len(JSON_BODY_END))
            if at == -1:
                self._scan_from = len(self._buf)
        if at == -1 and not final:
            return False
        body = self._buf if at == -1 else self._buf[:at]
        self._buf = "" if at == -1 else self._buf[at + len(JSON_BODY_END) :]
        calls = parse_json_calls(body, self.schemas)
        if calls is None:
            return self._fallback(out, body + ("" if at == -1 else JSON_BODY_END))
        for name, arguments in calls:
            self._emit_call(out, name, arguments)
        self._state = "content"
        return True

    def _emit_call(self, out: list[OutputEvent], name: str, arguments: str) -> None:
        """A whole call at once (JSON formats): start, one arguments fragment, end."""
        self._start_call(out, name)
        self._args(out, arguments)
        self._end_call(out)

    def _add_param(self, out: list[OutputEvent], key: str, value: Any) -> None:
        """One parameter of a call streamed parameter by parameter (XML formats); a key the
        call already has is dropped."""
        if key in self._seen_keys:
            return
        self._seen_keys.add(key)
        sep = ", " if self._num_params else "{"
        self._args(
            out,
            sep
            + json.dumps(key, ensure_ascii=False)
            + ": "
            + json.dumps(value, ensure_ascii=False),
        )
        self._num_params += 1

    def _param_streams(self, key: str) -> bool:
        """Whether this parameter's value streams as a JSON string (``schema.is_plain_string``)."""
        return key not in self._seen_keys and is_plain_string(self.param_schema(self._tool, key))

    def _open_string_param(self, out: list[OutputEvent], key: str) -> None:
        """Start a string parameter whose text follows in ``_string_param_text`` pieces."""
        self._seen_keys.add(key)
        sep = ", " if self._num_params else "{"
        self._args(out, sep + json.dumps(key, ensure_ascii=False) + ': "')
        self._num_params += 1

    def _string_param_text(self, out: list[OutputEvent], text: str) -> None:
        if text:
            self._args(out, json.dumps(text, ensure_ascii=False)[1:-1])

    def _close_string_param(self, out: list[OutputEvent]) -> None:
        self._args(out, '"')

    def _close_params(self, out: list[OutputEvent]) -> None:
        self._args(out, "}" if self._num_params else "{}")
        self._end_call(out)

    _tool = ""  # the call being read (XML formats)

    def param_schema(self, tool: str, param: str) -> dict | None:
        return self.schemas.get(tool, {}).get(param)
