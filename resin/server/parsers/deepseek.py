"""DeepSeek tool calls, both body shapes (parsers ``deepseek_v3`` and ``deepseek_v31``).

    V3 / R1:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
               ```json
               {"arg": 1}
               ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    V3.1/V3.2: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"arg": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The outer ``calls begin/end`` markers are dropped. Each ``call begin ... call end`` whose body
reaches a ``{`` in either shape (``function<sep>NAME`` + fence, or ``NAME<sep>``) streams: start
with the name, then the arguments as they arrive (``ToolParser._step_json_stream``), then end;
a code fence or other text after the object is dropped. Any other body (a fenced V3.1 body, a
body with no ``<sep>``) is read whole and decoded either way; when that fails, it goes out as
raw content, as does an unterminated call at ``finish`` unless its body already decodes.
"""

from __future__ import annotations

import json
import re

from .events import OutputEvent
from .tool_parser import ToolParser

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

_V3_BODY = re.compile(r"\s*function\s*" + SEP + r"\s*([^\n]+?)\s*\n\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)
_V31_BODY = re.compile(r"\s*([^\n]+?)\s*" + SEP + r"(.*)", re.DOTALL)
# Heads up to the arguments object; exclusive (after <sep>: a name vs "{"), so the shape chosen
# while streaming is the one the whole text would give.
_V3_HEAD = re.compile(r"\s*function\s*" + SEP + r"\s*(?P<name>[^\n{<]+?)\s*\n\s*```(?:json)?\s*(?=\{)")
_V31_HEAD = re.compile(r"\s*(?P<name>[^\n{<]+?)\s*" + SEP + r"\s*(?=\{)")
_FENCE = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)


def parse_deepseek_body(body: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of one call body (either shape), or ``None``."""
    match = _V3_BODY.fullmatch(body) or _V31_BODY.fullmatch(body)
    if match is None:
        return None
    name, args_text = match.group(1).strip(), match.group(2).strip()
    fenced = _FENCE.fullmatch(args_text)
    if fenced:
        args_text = fenced.group(1)
    if not name:
        return None
    try:
        args = json.loads(args_text) if args_text else {}
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)


class DeepSeekToolParser(ToolParser):
    start_markers = (CALL_BEGIN,)
    drop_markers = (CALLS_BEGIN, CALLS_END)
    json_heads = (_V3_HEAD, _V31_HEAD)
    call_end = CALL_END
    buffered_state = "body"

    def _open_call(self, marker: str) -> None:
        self._state = "json_head"

    def _step_body(self, out: list[OutputEvent], final: bool) -> bool:
        at = self._find(CALL_END)
        if at == -1 and not final:
            return False
        body = self._buf if at == -1 else self._buf[:at]
        self._buf = "" if at == -1 else self._buf[at + len(CALL_END):]
        call = parse_deepseek_body(body)
        if call is None:
            return self._fallback(out, body + ("" if at == -1 else CALL_END))
        self._emit_call(out, *call)
        self._state = "content"
        return True
