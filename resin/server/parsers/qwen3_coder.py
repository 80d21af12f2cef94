"""Qwen3-Coder / Qwen3.5 XML tool calls (parsers ``qwen3_coder``, ``qwen3_xml``)::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

Streams: ``ToolCallStart`` as soon as ``<function=NAME>`` is complete, one arguments fragment per
finished parameter (``{"a": 1`` then ``, "b": "x"``), and ``}`` (or ``{}``) with the end at
``</function>``. A value loses one leading and one trailing newline and is converted by the
tool's JSON schema (``schema.convert_value``). A value ends only at ``</parameter>``, so code
that contains ``</function>`` stays inside the value.

Lenient where Qwen models are known to slip: ``<function=`` without ``<tool_call>`` starts a
call; a missing ``</function>`` is closed by ``</tool_call>`` or by the next call; a hermes JSON
body (``<tool_call>{"name": ...}</tool_call>``) is read as hermes does. Text between parameters
is ignored. ``<tool_call>`` followed by something other than ``<function=`` is not a
call: its raw text is content. At ``finish`` a call whose name is known is closed with the
parameters read so far (a parameter cut off mid-value keeps the partial value).
"""

from __future__ import annotations

from .events import OutputEvent
from .holdback import expect_marker, split_at_marker
from .schema import convert_value
from .tool_parser import ToolParser

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def _trim_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class Qwen3CoderToolParser(ToolParser):
    start_markers: tuple[str, ...] = (TOOL_CALL, FUNCTION)
    _tool = ""  # the call being read
    _param = ""  # the parameter being read

    def _open_call(self, marker: str) -> None:
        self._state = "open" if marker == TOOL_CALL else "name"

    def _step_open(self, out: list[OutputEvent], final: bool) -> bool:
        """After ``<tool_call>``: expect ``<function=`` (or a hermes JSON body)."""
        if self._buf.lstrip()[:1] in ("{", "["):
            self._state = "json_head"
            return True
        found = expect_marker(self._buf, FUNCTION, final)
        if found is None:
            return False
        if not found:
            return self._fallback(out)  # the rest is scanned again as content
        at = self._buf.index(FUNCTION) + len(FUNCTION)
        self._raw += self._buf[:at]
        self._buf = self._buf[at:]
        self._state = "name"
        return True

    def _step_name(self, out: list[OutputEvent], final: bool) -> bool:
        at = self._buf.find(">")
        if at == -1 and not final:
            return False
        name = self._buf[:at].strip() if at != -1 else ""
        if not name or "<" in name or "\n" in name:
            return self._fallback(out)
        self._buf = self._buf[at + 1:]
        self._tool = name
        self._start_call(out, name)
        self._state = "function"
        return True

    def _step_function(self, out: list[OutputEvent], final: bool) -> bool:
        """Inside ``<function=...>``: parameters until the function (or the call) ends."""
        _, marker, after = split_at_marker(self._buf, (PARAMETER, FUNCTION_END, TOOL_CALL_END, TOOL_CALL, FUNCTION))
        if marker is None:
            if not final:
                self._buf = after  # text between parameters is ignored; keep a partial marker
                return False
            self._buf = ""
            self._close_params(out)
            self._state = "content"
            return True
        self._buf = after
        if marker == PARAMETER:
            self._state = "param_name"
            return True
        self._close_params(out)
        if marker == FUNCTION_END:
            self._state = "after_function"
        elif marker == TOOL_CALL_END:
            self._state = "content"
        else:  # the next call began before this one was closed
            self._raw = marker
            self._open_call(marker)
        return True

    def _step_param_name(self, out: list[OutputEvent], final: bool) -> bool:
        at = self._buf.find(">")
        if at == -1:
            if not final:
                return False
            self._buf = ""  # a parameter cut off inside its name is dropped
            self._state = "function"
            return True
        self._param = self._buf[:at].strip()
        self._buf = self._buf[at + 1:]
        self._state = "param_value"
        return True

    def _step_param_value(self, out: list[OutputEvent], final: bool) -> bool:
        at = self._find(PARAMETER_END)
        if at == -1:
            if not final:
                return False
            value = self._buf.split("\n" + FUNCTION_END, 1)[0]
            self._buf = ""
        else:
            value = self._buf[:at]
            self._buf = self._buf[at + len(PARAMETER_END):]
        raw = _trim_newline(value)
        self._add_param(out, self._param, convert_value(raw, self.param_schema(self._tool, self._param)))
        self._state = "function"
        return True

    def _step_after_function(self, out: list[OutputEvent], final: bool) -> bool:
        """After ``</function>``: swallow an optional ``</tool_call>``."""
        found = expect_marker(self._buf, TOOL_CALL_END, final)
        if found is None:
            return False
        if found:
            self._buf = self._buf.lstrip()[len(TOOL_CALL_END):]
        self._state = "content"
        return True
