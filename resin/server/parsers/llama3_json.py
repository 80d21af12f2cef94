"""Llama 3.x JSON tool calls (parser ``llama3_json``)::

    {"name": "get_weather", "parameters": {"city": "SF"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}

The output is tool calls only when, after optional whitespace, it *starts* with ``{`` or
``<|python_tag|>``; otherwise all of it is content, untouched. Objects may be separated by ``;``,
whitespace or further ``<|python_tag|>`` markers.

An object that starts ``{"name": "NAME", "parameters": {`` (or ``"arguments"``) streams: start
right there, the arguments as they arrive (``json_stream.JsonObjectStreamer``), the end when the
arguments object closes; the rest of the call object is skipped. If the arguments turn invalid,
the call ends with their valid part and the rest of the output is content. Any other object is
decoded once its braces balance (a string-aware scan) and emitted whole if it is a call.

An object that is not a call (no string ``name``, arguments not an object), or any other text
after a call, ends call mode: that text and everything after it is content. At ``finish`` text
that never became a complete object is content too, raw (the leading ``<|python_tag|>`` and
separators included when no call was made); a streaming call is closed with what arrived.
"""

from __future__ import annotations

import json
import re

from .events import OutputEvent
from .holdback import expect_marker
from .json_stream import JsonObjectStreamer
from .tool_parser import ToolParser, call_from_json

PYTHON_TAG = "<|python_tag|>"
# A call object up to its arguments object: what lets the arguments stream.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"(?P<name>[^"\\\n]+)"\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)')


class Llama3JsonToolParser(ToolParser):
    initial_state = "start"
    # Brace scanner state for the object at the start of the buffer (see _object_end).
    _scan_pos, _depth, _in_string, _escaped = 0, 0, False, False

    def _step_start(self, out: list[OutputEvent], final: bool) -> bool:
        stripped = self._buf.lstrip()
        if not stripped and not final:
            return False
        if stripped.startswith("{"):
            self._state = "calls"
            return True
        found = expect_marker(self._buf, PYTHON_TAG, final)
        if found is None:
            return False
        self._state = "calls" if found else "passthrough"
        return True

    def _step_passthrough(self, out: list[OutputEvent], final: bool) -> bool:
        self._content(out, self._buf)
        self._buf = ""
        return False

    def _step_calls(self, out: list[OutputEvent], final: bool) -> bool:
        """Skip separators, then decode the next object once it is complete."""
        at = 0
        while True:
            while at < len(self._buf) and (self._buf[at].isspace() or self._buf[at] == ";"):
                at += 1
            if self._buf.startswith(PYTHON_TAG, at):
                at += len(PYTHON_TAG)
                continue
            break
        if at:
            self._raw += self._buf[:at]
            self._buf = self._buf[at:]
        if not self._buf:
            if final and self.num_calls == 0 and self._raw:
                return self._leave_calls(out)  # a lone <|python_tag|>: keep it as text
            return False
        if not self._buf.startswith("{"):
            if not final and PYTHON_TAG.startswith(self._buf):
                return False  # maybe a python tag split across deltas
            return self._leave_calls(out)
        match = _HEAD.match(self._buf)
        if match:
            self._buf = self._buf[match.end():]
            self._scan_pos, self._depth, self._in_string, self._escaped = 0, 0, False, False
            self._start_call(out, match.group("name").strip())
            self._streamer = JsonObjectStreamer()
            self._state = "arguments"
            return True
        end = self._object_end()
        if end == -1:
            if not final:
                return False
            return self._leave_calls(out)  # never completed
        try:
            obj = json.loads(self._buf[:end])
        except ValueError:
            return self._leave_calls(out)  # balanced but not JSON
        call = call_from_json(obj, ("parameters", "arguments"))
        if call is None:
            return self._leave_calls(out)
        self._buf = self._buf[end:]
        self._emit_call(out, *call)
        return True

    def _step_arguments(self, out: list[OutputEvent], final: bool) -> bool:
        """A call's arguments object, released as it validates."""
        text, used = self._streamer.feed(self._buf)
        self._args(out, text)
        self._buf = self._buf[used:]
        if self._streamer.done:
            self._end_call(out)
            # What is left of the call object (its closing brace) is skipped by the scanner.
            self._scan_pos, self._depth, self._in_string, self._escaped = 0, 1, False, False
            self._state = "call_tail"
            return True
        if self._streamer.error or final:
            self._args(out, self._streamer.close())
            self._end_call(out)
            if self._streamer.error:
                return self._leave_calls(out)  # the rest, from the invalid character on, is content
        return False

    def _step_call_tail(self, out: list[OutputEvent], final: bool) -> bool:
        end = self._object_end()
        if end == -1:
            self._buf, self._scan_pos = "", 0
            return False
        self._buf = self._buf[end:]
        self._state = "calls"
        return True

    def _object_end(self) -> int:
        """End index of the object that starts the buffer, once its braces balance, else -1.

        Scans only what arrived since the last call (string-aware), so an object streamed in
        many deltas is scanned once, and decoded once.
        """
        buf, at = self._buf, self._scan_pos
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        while at < len(buf):
            ch = buf[at]
            at += 1
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    self._scan_pos, self._depth, self._in_string, self._escaped = 0, 0, False, False
                    return at
        self._scan_pos, self._depth, self._in_string, self._escaped = at, depth, in_string, escaped
        return -1

    def _leave_calls(self, out: list[OutputEvent]) -> bool:
        self._content(out, self._raw)
        self._raw = ""
        self._state = "passthrough"
        return True
