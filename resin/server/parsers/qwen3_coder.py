"""Qwen3-Coder / Qwen3.5 XML tool calls (parsers ``qwen3_coder``, ``qwen3_xml``)::

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

Streams: ``ToolCallStart`` as soon as ``<function=NAME>`` is complete; a string parameter (by
the tool's JSON schema, or one the schema does not know) as its text arrives; any other
parameter in one fragment once finished (``{"a": 1`` then ``, "b": "x"``); and ``}`` (or ``{}``)
with the end at ``</function>``. A value loses one leading and one trailing newline and is
converted by the tool's JSON schema (``schema.convert_value``). ``NAME`` must be a function name
(``tool_parser.is_function_name``): ``<function={{ tc.name }}>`` is text.

Where a value ends (the rules of vLLM's ``qwen3_coder`` parser, decided as text arrives). A
value holds code, so the closing tags can occur inside it as text:

* ``</parameter>`` ends it only when what follows (after whitespace) is structure: ``</function>``,
  ``</tool_call>``, ``<tool_call>``, the end of the output, or a ``<parameter=NAME>`` tag that
  names a parameter of the tool (any name when the tool has no schema; an undeclared name when
  laid out as the template does, ``</parameter>\n<parameter=NAME>\n``). Any other
  ``</parameter>`` is part of the value. A parameter whose schema type cannot be text
  (number, boolean, object, array) ends at its first tag: ``</parameter>``, a
  ``<parameter=NAME>`` (its ``</parameter>`` was forgotten), ``</function>``, ``</tool_call>``.
* A ``<parameter=NAME>`` at the start of a line inside the value opens a nested level (a tool
  call quoted in the value); the next ``</parameter>`` closes that level, not the value.
* A value whose ``</parameter>`` never comes (the model forgot it) is closed by the call's end:
  a ``</tool_call>`` followed by the end of the output or the next ``<tool_call>`` (as vLLM
  splits calls), a ``</function>`` followed by the next call (``<tool_call><function=``,
  ``<function=``) or the end, or the end of the output. The value then ends at the first nested
  ``<parameter=NAME>`` that names another parameter of the tool not given yet (that parameter
  and those after it are read again as parameters), else at that ``</function>`` (or
  ``</tool_call>``, or the end).

A parameter given twice in one call keeps its first value. Lenient where Qwen models are known to
slip: ``<function=`` without ``<tool_call>`` starts a call; a missing ``</function>`` is closed
by ``</tool_call>`` or by the next call; a hermes JSON body (``<tool_call>{"name": ...}
</tool_call>``) is read as hermes does. Text between parameters is ignored. ``<tool_call>``
followed by something other than ``<function=`` is not a call: its raw text is content. At
``finish`` a call whose name is known is closed with the parameters read so far (a parameter cut
off mid-value keeps the partial value).
"""

from __future__ import annotations

from typing import Literal

from .events import OutputEvent
from .holdback import expect_marker, split_at_marker
from .schema import allows_text, convert_value
from .tool_parser import MAX_NAME, ToolParser, could_be_function_name, is_function_name

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_VALUE_MARKERS = (PARAMETER, PARAMETER_END, FUNCTION_END, TOOL_CALL_END)
_NEXT_CALL = (TOOL_CALL, FUNCTION)


def _trim_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class Qwen3CoderToolParser(ToolParser):
    start_markers: tuple[str, ...] = (TOOL_CALL, FUNCTION)
    _param = ""  # the parameter being read
    # The value being read is self._buf[:end]; its scan (see _scan_value):
    _vpos = 0  # resume point: everything before it has been classified
    _vdepth = 0  # nested <parameter=...> levels open
    _vopens: list[int] = []  # nested opens that could close the value (forgotten </parameter>)
    _vhold = -1  # text from here may not belong to the value: not streamed yet
    _vtext = True  # the value may be free text (holding markup)
    _vstream = False  # the value streams as a JSON string
    _vsent = 0  # characters of the (trimmed) value streamed so far

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
        if at == -1:
            if not final and could_be_function_name(self._buf, self.schemas):
                return False
            return self._fallback(out)
        name = self._buf[:at].strip()
        if at > 2 * MAX_NAME or not is_function_name(name, self.schemas):
            return self._fallback(out)  # prose or a template that leaked: content
        self._buf = self._buf[at + 1 :]
        self._tool = name
        self._start_call(out, name)
        self._state = "function"
        return True

    def _step_function(self, out: list[OutputEvent], final: bool) -> bool:
        """Inside ``<function=...>``: parameters until the function (or the call) ends."""
        _, marker, after = split_at_marker(
            self._buf, (PARAMETER, FUNCTION_END, TOOL_CALL_END, TOOL_CALL, FUNCTION)
        )
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
        self._buf = self._buf[at + 1 :]
        self._vpos, self._vdepth, self._vopens, self._vhold = 0, 0, [], -1
        self._vsent = 0
        self._skip_param = self._param in self._seen_keys
        self._vstream = self._param_streams(self._param)
        self._vtext = allows_text(self.param_schema(self._tool, self._param))
        if self._vstream:
            self._open_string_param(out, self._param)
        self._state = "param_value"
        return True

    # -- one parameter's value -----------------------------------------------------------------

    def _step_param_value(self, out: list[OutputEvent], final: bool) -> bool:
        end, resume = self._scan_value(final)
        if end == -1:
            if not final:
                self._stream_value(out, resume)
                return False
            # The output ended inside the value: as at a call end (see the module doc).
            end = resume = self._vopens[0] if self._vopens else len(self._buf)
        raw = _trim_newline(self._buf[:end])
        self._buf = self._buf[resume:]
        self._scan_from = 0
        if self._skip_param:
            pass  # a parameter the call already has
        elif self._vstream:
            self._string_param_text(out, raw[self._vsent :])
            self._close_string_param(out)
        else:
            self._add_param(
                out, self._param, convert_value(raw, self.param_schema(self._tool, self._param))
            )
        self._state = "function"
        return True

    def _scan_value(self, final: bool) -> tuple[int, int]:
        """``(end of the value, where the text after it resumes)``, or ``(-1, limit)`` when the
        end is not known yet (``limit``: text before it is surely inside the value, unless
        held by ``_vhold``). Resumes at ``_vpos``; state before it is never revisited."""
        buf = self._buf
        pos = self._vpos
        while True:
            at = buf.find("<", pos)
            if at == -1:
                self._vpos = len(buf)
                return -1, len(buf)
            marker = next((m for m in _VALUE_MARKERS if buf.startswith(m, at)), None)
            if marker is None:
                if not final and any(m.startswith(buf[at:]) for m in _VALUE_MARKERS):
                    self._vpos = at  # a marker may be arriving
                    return -1, at
                pos = at + 1
                continue
            after = at + len(marker)
            if not self._vtext:  # a number, boolean, object or array holds no tags: any ends it
                if marker == PARAMETER_END:
                    return at, after
                if marker != PARAMETER:
                    return at, at
                name = self._tag_name(buf, after, final)
                if name is None:
                    self._vpos = at
                    return -1, at
                if name is not False:
                    return at, at
                pos = after
                continue
            if marker == PARAMETER:
                if at == 0 or buf[at - 1] == "\n":
                    name = self._tag_name(buf, after, final)
                    if name is None:
                        self._vpos = at
                        return -1, at
                    if name is not False:
                        if self._vdepth == 0 and self._closes_value(name):
                            self._vopens.append(at)
                            self._hold(at)
                        self._vdepth += 1
                        pos = buf.index(">", after) + 1
                        continue
                pos = after
                continue
            if marker == PARAMETER_END:
                if self._vdepth:
                    self._vdepth -= 1  # closes a nested (quoted) parameter
                    pos = after
                    continue
                follows = self._ends_after_parameter(buf, after, final)
                if follows is None:
                    self._vpos = at
                    return -1, at
                if follows:
                    return at, after
                pos = after
                continue
            # </function> or </tool_call>: text, unless the value never got its </parameter>
            # and the call ends here.
            self._hold(at)
            follows = self._ends_call(buf, marker, after, final)
            if follows is None:
                self._vpos = at
                return -1, at
            if follows:
                end = self._vopens[0] if self._vopens else at
                if not self._vopens and marker == TOOL_CALL_END:
                    before = buf[:at].rstrip()
                    if before.endswith(FUNCTION_END):
                        end = len(before) - len(FUNCTION_END)
                return end, end  # the text from there is read again as parameters / the end
            pos = after

    def _hold(self, at: int) -> None:
        if self._vhold < 0:
            self._vhold = at

    def _stream_value(self, out: list[OutputEvent], limit: int) -> None:
        """Stream the part of a string value that is surely in it (not a possible last newline)."""
        if not self._vstream or not self._buf:
            return
        if self._vhold >= 0:
            limit = min(limit, self._vhold)
        start = 1 if self._buf.startswith("\n") else 0
        if limit > start and self._buf[limit - 1] == "\n":
            limit -= 1
        if limit - start > self._vsent:
            self._string_param_text(out, self._buf[start + self._vsent : limit])
            self._vsent = limit - start

    @staticmethod
    def _tag_name(text: str, at: int, final: bool) -> str | Literal[False] | None:
        """The NAME of ``<parameter=NAME>`` whose NAME starts at ``at``: a string, ``False`` when
        this is not such a tag, ``None`` when more text is needed to tell."""
        gt = text.find(">", at)
        segment = text[at:] if gt == -1 else text[at:gt]
        if "\n" in segment or len(segment) > MAX_NAME:
            return False
        if gt == -1:
            return False if final else None
        name = segment.strip()
        return name if name else False

    def _known_param(self, name: str) -> bool:
        props = self.schemas.get(self._tool)
        return name in props if props else is_function_name(name)

    def _closes_value(self, name: str) -> bool:
        """Whether a nested ``<parameter=NAME>`` could be the next parameter of this call."""
        return name != self._param and name not in self._seen_keys and self._known_param(name)

    def _ends_after_parameter(self, text: str, at: int, final: bool) -> bool | None:
        """Whether the ``</parameter>`` ending just before ``at`` closes the value."""
        rest = text[at:].lstrip()
        if not rest:
            return True if final else None
        if rest.startswith((FUNCTION_END, TOOL_CALL_END, TOOL_CALL)):
            return True
        if rest.startswith(PARAMETER):
            name = self._tag_name(rest, len(PARAMETER), final)
            if name is None or name is False:
                return name
            if self._known_param(name):
                return True
            if not is_function_name(name):
                return False
            # A name the tool's schema does not declare: a parameter only when laid out as the
            # template lays parameters out, "</parameter>\n<parameter=NAME>\n".
            after_tag = rest[rest.index(">") + 1 :][:1]
            if not after_tag:
                return False if final else None
            return text[at : len(text) - len(rest)] == "\n" and after_tag == "\n"
        if not final and any(
            m.startswith(rest) for m in (FUNCTION_END, TOOL_CALL_END, TOOL_CALL, PARAMETER)
        ):
            return None
        return False

    def _ends_call(self, text: str, marker: str, at: int, final: bool) -> bool | None:
        """Whether ``marker``, ending just before ``at``, is where the call ends: a
        ``</tool_call>`` followed by the end of the output or the next ``<tool_call>``; a
        ``</function>`` followed by the end or by the next call (``<tool_call>`` then
        ``<function=``, or ``<function=``) without its ``</tool_call>``."""
        rest = text[at:].lstrip()
        if not rest:
            return True if final else None
        if marker == TOOL_CALL_END:
            if rest.startswith(TOOL_CALL):
                return True
            return None if not final and TOOL_CALL.startswith(rest) else False
        if rest.startswith(FUNCTION):
            return True
        if rest.startswith(TOOL_CALL):
            rest = rest[len(TOOL_CALL) :].lstrip()
            if rest.startswith(FUNCTION):
                return True
            return None if not final and FUNCTION.startswith(rest) else False
        if not final and (FUNCTION.startswith(rest) or TOOL_CALL.startswith(rest)):
            return None
        return False

    def _step_after_function(self, out: list[OutputEvent], final: bool) -> bool:
        """After ``</function>``: swallow an optional ``</tool_call>``."""
        found = expect_marker(self._buf, TOOL_CALL_END, final)
        if found is None:
            return False
        if found:
            self._buf = self._buf.lstrip()[len(TOOL_CALL_END) :]
        self._state = "content"
        return True
