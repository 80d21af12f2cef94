"""Kimi K2 tool calls (parser ``kimi_k2``; Moonshot's Kimi K2 / K2.5, DeepSeek-V3 architecture).

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>

A call's header is its id, ``functions.NAME:INDEX`` (the model numbers its calls); the name is
what comes between ``functions.`` and ``:INDEX`` (a header without them is taken whole as the
name). The structure is DeepSeek's block of calls (:class:`DeepSeekToolParser`: the section
markers are dropped only when a call forms inside them, a call whose arguments reach ``{``
streams, any other body is read whole and decoded, or given back as text). The markers are
special tokens in Kimi's tokenizer, so the server keeps special tokens in the text for this
parser (``needs_special_tokens``), and the parser removes the markers it reads.
"""

from __future__ import annotations

import json
import re

from .deepseek import DeepSeekToolParser
from .tool_parser import is_function_name

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"

# The header up to the arguments object: "functions.NAME:INDEX" (prefix and index optional).
_HEAD = re.compile(
    r"\s*(?:functions\.)?(?P<name>[^\s:<{]+?)(?::\d+)?\s*"
    + re.escape(ARGUMENT_BEGIN)
    + r"\s*(?=\{)"
)
_BODY = re.compile(
    r"\s*(?:functions\.)?(?P<name>[^\s:<{]+?)(?::\d+)?\s*"
    + re.escape(ARGUMENT_BEGIN)
    + r"(?P<arguments>.*)",
    re.DOTALL,
)


class KimiK2ToolParser(DeepSeekToolParser):
    needs_special_tokens = True  # the markers are special tokens: keep them in the text
    calls_begin, calls_end, call_begin = SECTION_BEGIN, SECTION_END, CALL_BEGIN
    start_markers = (CALL_BEGIN,)
    reasoning_exit_markers = (SECTION_BEGIN, CALL_BEGIN)
    json_heads = (_HEAD,)
    call_end = CALL_END

    def parse_body(self, body: str) -> tuple[str, str] | None:
        match = _BODY.fullmatch(body)
        if match is None or not is_function_name(match.group("name"), self.schemas):
            return None
        text = match.group("arguments").strip()
        try:
            arguments = json.loads(text) if text else {}
        except ValueError:
            return None
        if not isinstance(arguments, dict):
            return None
        return match.group("name"), json.dumps(arguments, ensure_ascii=False)
