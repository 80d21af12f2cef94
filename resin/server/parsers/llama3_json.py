"""Llama 3.x JSON tool calls (parser ``llama3_json``)::

    {"name": "get_weather", "parameters": {"city": "SF"}}
    Let me check.<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}

Calls start where the output *starts* with ``{`` (after optional whitespace), or at any
``<|python_tag|>``: text before the tag is content (vLLM's non-streaming ``llama3_json`` parser
reads call objects after any text too). A ``{`` elsewhere is text. Objects may be separated by
``;``, whitespace or further ``<|python_tag|>`` markers.

A call is emitted only once its whole object has arrived (braces balanced, a string-aware
scan), decodes as JSON, has a function name (``tool_parser.is_function_name``) and an arguments
object (``"parameters"`` or ``"arguments"``, absent meaning ``{}``): start, one arguments
fragment, end. Nothing streams before that, so an object that turns out not to be a call never
leaves a phantom call with part of its arguments behind (a bare ``{"name": ...}`` JSON answer is
a plausible non-call). An object that is not a call, or any other text after a call, ends call
mode: that text is content (a later ``<|python_tag|>`` starts call mode again). At ``finish``
text that never became a complete object is content too, raw (the ``<|python_tag|>`` and
separators before it included when no call was made in this run).
"""

from __future__ import annotations

import json

from .events import OutputEvent
from .holdback import expect_marker
from .tool_parser import ToolParser, call_from_json

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    initial_state = "start"
    start_markers = (PYTHON_TAG,)
    # Brace scanner state for the object at the start of the buffer (see _object_end).
    _scan_pos, _depth, _in_string, _escaped = 0, 0, False, False

    def in_plain_content(self) -> bool:
        return self._state in ("start", "content") and self.num_calls == 0

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
        self._state = "content"  # the content scan finds a leading tag too
        return True

    def _open_call(self, marker: str) -> None:
        self._state = "calls"

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
            self._scan_pos = 0
        if not self._buf:
            if final and self._raw and not self.num_calls:
                return self._leave_calls(out)  # a lone <|python_tag|>: keep it as text
            return False
        if not self._buf.startswith("{"):
            if not final and PYTHON_TAG.startswith(self._buf):
                return False  # maybe a python tag split across deltas
            return self._leave_calls(out)
        end = self._object_end()
        if end == -1:
            if not final:
                return False
            return self._leave_calls(out)  # never completed
        try:
            obj = json.loads(self._buf[:end])
        except ValueError:
            return self._leave_calls(out)  # balanced but not JSON
        call = call_from_json(obj, ("parameters", "arguments"), self.schemas)
        if call is None:
            return self._leave_calls(out)
        self._buf = self._buf[end:]
        self._emit_call(out, *call)
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
        self._scan_pos, self._depth, self._in_string, self._escaped = 0, 0, False, False
        self._state = "content"
        return True
