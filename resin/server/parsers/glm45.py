"""GLM-4.5 / 4.6 XML tool calls (parser ``glm45``)::

    <tool_call>NAME
    <arg_key>city</arg_key>
    <arg_value>SF</arg_value>
    </tool_call>

GLM-4.7 (parser ``glm47``, the same class) writes the same tags without the newlines:
``<tool_call>NAME<arg_key>city</arg_key><arg_value>SF</arg_value></tool_call>``.

Streams: ``ToolCallStart`` once the name line ends (at a newline, ``<arg_key>`` or
``</tool_call>``); a string value (by the tool's JSON schema, or a key the schema does not know)
as its text arrives, any other value in one fragment once its pair is finished; and ``}`` (or
``{}``) with the end at ``</tool_call>``. Values are converted by the tool's JSON schema
(``schema.convert_value``: JSON-parsed unless the parameter is a string or unknown; a number
quoted as ``"5"`` for a numeric parameter is the number). A value ends only at
``</arg_value>``. Text between pairs is ignored; a key given twice keeps its first value.

A hermes JSON body (``<tool_call>{"name": ...}</tool_call>``) is read as hermes does. A name
that is empty or does not look like a function name (``<``, spaces, quotes) means this is not a call: its raw text is content. At ``finish`` a call whose name is known is closed with the
pairs read so far (a value cut off mid-way keeps the partial text; a key without a value is
dropped); a call still inside its name line becomes content.
"""

from __future__ import annotations

import re

from .events import OutputEvent
from .holdback import expect_marker, partial_tail, split_at_marker
from .schema import convert_value
from .tool_parser import ToolParser

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"
_NAME = re.compile(r"[A-Za-z0-9_.:/\-]+")
_NAME_PREFIX = re.compile(r"[A-Za-z0-9_.:/\-]*\s*")  # a name still arriving (or its line end)


class Glm45ToolParser(ToolParser):
    start_markers = (TOOL_CALL,)
    _tool = ""  # the call being read
    _key = ""  # the argument being read
    _vstream = False  # its value streams as a JSON string
    _vsent = 0  # characters of the value streamed so far

    def _open_call(self, marker: str) -> None:
        self._state = "name"

    def _step_name(self, out: list[OutputEvent], final: bool) -> bool:
        if self._buf.lstrip().startswith("{"):
            self._state = "json_head"  # a hermes JSON body instead of the XML form
            return True
        before, marker, after = split_at_marker(self._buf, ("\n", KEY, TOOL_CALL_END))
        if marker == "\n" and not before.strip():
            self._raw += before + marker  # a newline right after <tool_call>
            self._buf = after
            return True
        if marker is None:
            if not final and _NAME_PREFIX.fullmatch(before.lstrip()):
                return False
            return self._fallback(out)  # prose after the tag, not a name: content at once
        name = before.strip()
        if not _NAME.fullmatch(name):
            return self._fallback(out)  # the rest is scanned again as content
        self._buf = after
        self._tool = name
        self._start_call(out, name)
        if marker == TOOL_CALL_END:
            self._close_params(out)
            self._state = "content"
        else:
            self._state = "key" if marker == KEY else "args"
        return True

    def _step_args(self, out: list[OutputEvent], final: bool) -> bool:
        _, marker, after = split_at_marker(self._buf, (KEY, TOOL_CALL_END))
        self._buf = after
        if marker is None and not final:
            return False
        if marker == KEY:
            self._state = "key"
            return True
        self._buf = "" if marker is None else after
        self._close_params(out)
        self._state = "content"
        return True

    def _step_key(self, out: list[OutputEvent], final: bool) -> bool:
        at = self._find(KEY_END)
        if at == -1:
            if not final:
                return False
            self._buf = ""
            self._state = "args"  # a key cut off mid-way is dropped
            return True
        self._key = self._buf[:at].strip()
        self._buf = self._buf[at + len(KEY_END) :]
        self._state = "value_open"
        return True

    def _step_value_open(self, out: list[OutputEvent], final: bool) -> bool:
        found = expect_marker(self._buf, VALUE, final)
        if found is None:
            return False
        if found:
            self._buf = self._buf.lstrip()[len(VALUE) :]
            self._skip_param = self._key in self._seen_keys
            self._vstream = self._param_streams(self._key)
            self._vsent = 0
            if self._vstream:
                self._open_string_param(out, self._key)
            self._state = "value"
        else:
            self._state = "args"  # a key without a value is dropped
        return True

    def _step_value(self, out: list[OutputEvent], final: bool) -> bool:
        at = self._find(VALUE_END)
        if at == -1 and not final:
            if self._vstream:  # release all but a possible partial </arg_value>
                limit = len(self._buf) - partial_tail(self._buf, (VALUE_END,))
                self._string_param_text(out, self._buf[self._vsent : limit])
                self._vsent = max(self._vsent, limit)
            return False
        value = self._buf if at == -1 else self._buf[:at]
        self._buf = "" if at == -1 else self._buf[at + len(VALUE_END) :]
        if self._skip_param:
            pass  # a key the call already has
        elif self._vstream:
            self._string_param_text(out, value[self._vsent :])
            self._close_string_param(out)
        else:
            self._add_param(
                out, self._key, convert_value(value, self.param_schema(self._tool, self._key))
            )
        self._state = "args"
        return True
