"""DeepSeek tool calls, both body shapes (parsers ``deepseek_v3`` and ``deepseek_v31``).

    V3 / R1:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
               ```json
               {"arg": 1}
               ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    V3.1/V3.2: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"arg": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Each ``call begin ... call end`` whose body reaches a ``{`` in either shape (``function<sep>NAME``
+ fence, or ``NAME<sep>``) streams: start with the name, then the arguments as they arrive
(``ToolParser._step_json_stream``), then end; a code fence or other text after the object is
dropped. Any other body (a fenced V3.1 body, a body with no ``<sep>``) is read whole and decoded
either way; when that fails, it goes out as raw content, as does an unterminated call at
``finish`` unless its body already decodes. ``NAME`` must be a function name.

The outer ``calls begin ... calls end`` block is dropped only when a call forms inside it:
after ``calls begin``, content is held until the block's first call (then released without the
marker) or its end / the end of the output (then released with the markers, as text). A
``calls end`` outside a block is dropped once a call was made, else it is text.
"""

from __future__ import annotations

import json
import re

from .events import OutputEvent
from .holdback import split_at_marker
from .schema import ToolSchemas
from .tool_parser import ToolParser, is_function_name

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

_V3_BODY = re.compile(
    r"\s*function\s*" + SEP + r"\s*([^\n]+?)\s*\n\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL
)
_V31_BODY = re.compile(r"\s*([^\n]+?)\s*" + SEP + r"(.*)", re.DOTALL)
# Heads up to the arguments object; exclusive (after <sep>: a name vs "{"), so the shape chosen
# while streaming is the one the whole text would give.
_V3_HEAD = re.compile(
    r"\s*function\s*" + SEP + r"\s*(?P<name>[^\n{<]+?)\s*\n\s*```(?:json)?\s*(?=\{)"
)
_V31_HEAD = re.compile(r"\s*(?P<name>[^\n{<]+?)\s*" + SEP + r"\s*(?=\{)")
_FENCE = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)


def parse_deepseek_body(body: str, schemas: ToolSchemas | None = None) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of one call body (either shape), or ``None``."""
    match = _V3_BODY.fullmatch(body) or _V31_BODY.fullmatch(body)
    if match is None:
        return None
    name, args_text = match.group(1).strip(), match.group(2).strip()
    fenced = _FENCE.fullmatch(args_text)
    if fenced:
        args_text = fenced.group(1)
    if not is_function_name(name, schemas):
        return None
    try:
        args = json.loads(args_text) if args_text else {}
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


class DeepSeekToolParser(ToolParser):
    """The block-of-calls formats: ``calls_begin`` (``call_begin`` body ``call_end``)...
    ``calls_end``. Subclasses with the same structure set the four markers, ``json_heads``
    and :meth:`parse_body` (Kimi K2)."""

    calls_begin, calls_end, call_begin = CALLS_BEGIN, CALLS_END, CALL_BEGIN
    start_markers = (CALL_BEGIN,)
    reasoning_exit_markers: tuple[str, ...] = (CALLS_BEGIN, CALL_BEGIN)
    json_heads: tuple[re.Pattern[str], ...] = (_V3_HEAD, _V31_HEAD)
    call_end = CALL_END
    buffered_state = "body"
    _block: str | None = None  # inside calls begin, before its first call: the text held
    _in_block = False  # between calls begin and calls end

    def parse_body(self, body: str) -> tuple[str, str] | None:
        """``(name, arguments JSON)`` of one call body read whole, or ``None``."""
        return parse_deepseek_body(body, self.schemas)

    def _open_call(self, marker: str) -> None:
        self._state = "json_head"

    def in_plain_content(self) -> bool:
        return super().in_plain_content() and self._block is None

    def _step_content(self, out: list[OutputEvent], final: bool) -> bool:
        markers = (self.call_begin, self.calls_begin, self.calls_end)
        before, marker, after = split_at_marker(self._buf, markers)
        if marker is None:
            self._content(out, self._buf if final else before)
            self._buf = "" if final else after
            return False
        self._content(out, before)
        self._buf = after
        self._scan_from = 0
        if marker == self.call_begin:
            self._raw = marker
            self._open_call(marker)
        elif marker == self.calls_begin:
            if self._block is None and not self._in_block:
                self._block, self._in_block = "", True
            else:
                self._content(out, marker)  # a second begin inside a block: text
        elif self._in_block:  # calls end
            held, self._block, self._in_block = self._block, None, False
            if held is not None:  # no call formed in the block: all of it is text
                super()._content(out, self.calls_begin + held + marker)
        elif not self.num_calls:
            self._content(out, marker)
        return True

    def _content(self, out: list[OutputEvent], text: str) -> None:
        if self._block is not None:
            self._block += text
        else:
            super()._content(out, text)

    def _start_call(self, out: list[OutputEvent], name: str) -> None:
        if self._block is not None:  # the block's first call: its markers were structure
            held, self._block = self._block, None
            super()._content(out, held)
        super()._start_call(out, name)

    def _at_finish(self, out: list[OutputEvent]) -> None:
        if self._block is not None:
            held, self._block = self._block, None
            super()._content(out, self.calls_begin + held)

    def _step_body(self, out: list[OutputEvent], final: bool) -> bool:
        at = self._find(self.call_end)
        if at == -1 and not final:
            return False
        body = self._buf if at == -1 else self._buf[:at]
        self._buf = "" if at == -1 else self._buf[at + len(self.call_end) :]
        call = self.parse_body(body)
        if call is None:
            return self._fallback(out, body + ("" if at == -1 else self.call_end))
        self._emit_call(out, *call)
        self._state = "content"
        return True
