"""Hermes-style tool calls (Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Each block is read whole, up to ``</tool_call>``, then decoded (``ToolParser._step_json_body``):
the call goes out as start, one arguments fragment (``json.dumps(arguments, ensure_ascii=False)``)
and end. The arguments are not streamed piece by piece: the model's JSON is re-encoded, and it
must be known to be valid before any of it is sent. Several blocks give several calls; a block
holding a JSON list of call objects gives one call per element; ``"parameters"`` is accepted for
``"arguments"``, and arguments given as a JSON string are decoded.

A block whose body is not a call object (bad JSON, no ``name``, arguments not an object) is not a
call: its raw text, markers included, goes out as content. At ``finish`` an unterminated block is
still a call when its body already decodes; otherwise it too becomes content.
"""

from __future__ import annotations

from .tool_parser import ToolParser


class HermesToolParser(ToolParser):
    start_markers = ("<tool_call>",)

    def _open_call(self, marker: str) -> None:
        self._state = "json_body"
