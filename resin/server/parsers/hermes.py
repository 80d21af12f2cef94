"""Hermes-style tool calls (Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Each block is read whole, up to ``</tool_call>``, then decoded: the call goes out as start, one
arguments fragment (``json.dumps(arguments, ensure_ascii=False)``) and end. Several blocks give
several calls; a block holding a JSON list of call objects gives one call per element.

A block whose body is not a call object (bad JSON, no ``name``, arguments not an object) is not a
call: its raw text, markers included, goes out as content. At ``finish`` an unterminated block is
still a call when its body already decodes; otherwise it too becomes content.
"""

from __future__ import annotations

import json

from .events import OutputEvent
from .tool_parser import ToolParser, call_from_json

START, END = "<tool_call>", "</tool_call>"


def parse_hermes_body(body: str) -> list[tuple[str, str]] | None:
    """``[(name, arguments JSON)]`` for a block body, or ``None`` when it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_from_json(item, ("arguments", "parameters")) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


class HermesToolParser(ToolParser):
    start_markers = (START,)

    def _open_call(self, marker: str) -> None:
        self._state = "body"

    def _step_body(self, out: list[OutputEvent], final: bool) -> bool:
        at = self._find(END)
        if at == -1 and not final:
            return False
        body = self._buf if at == -1 else self._buf[:at]
        self._buf = "" if at == -1 else self._buf[at + len(END):]
        calls = parse_hermes_body(body)
        if calls is None:
            return self._fallback(out, body + ("" if at == -1 else END))
        for name, arguments in calls:
            self._emit_call(out, name, arguments)
        self._state = "content"
        return True
