"""Output parsing for the server: reasoning, content and tool calls out of generated text.

``OutputParser`` (``output_parser.py``) is the one entry point; it chains a reasoning parser
(``reasoning.py``) and a tool-call parser (``hermes.py``, ``qwen3_coder.py``, ``deepseek.py``,
``dsml.py``, ``glm45.py``, ``llama3_json.py``, all built on ``tool_parser.py``; ``harmony.py``
holds both parsers of gpt-oss's harmony format) chosen by name from
``registry.py``. Events are defined in ``events.py``; ``holdback.py`` finds markers in streamed
text, ``json_stream.py`` streams JSON arguments, ``schema.py`` converts XML parameter values.
Standard library only.
"""

from .events import (
    ContentDelta,
    OutputEvent,
    ParsedToolCall,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from .output_parser import OutputParser, needs_special_tokens
from .registry import REASONING_PARSERS, TOOL_PARSERS, default_parsers

__all__ = [
    "ContentDelta",
    "OutputEvent",
    "OutputParser",
    "ParsedToolCall",
    "REASONING_PARSERS",
    "ReasoningDelta",
    "TOOL_PARSERS",
    "ToolCallArgumentsDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "default_parsers",
    "needs_special_tokens",
]
