"""Hermes-style tool calls (Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

A block whose body starts ``{"name": "NAME", "arguments": {`` (or ``"parameters"``) streams:
``ToolCallStart`` right there, then the arguments as they arrive, validated and normalized
(``json_stream.JsonObjectStreamer``: ``", "`` / ``": "`` separators, strings as written), then
the end at ``</tool_call>``. If the arguments turn invalid midway, the call ends with their
valid part and the rest of the block goes out as content; a block cut off by the end of the
generation ends the same way.

Any other body (name after arguments, arguments as a JSON string, a list of calls) is read whole
up to ``</tool_call>`` and decoded (``ToolParser._step_json_body``): start, one arguments
fragment (``json.dumps(arguments, ensure_ascii=False)``), end. If it is not a call object (bad
JSON, no ``name``, arguments not an object), its raw text, markers included, is content; at
``finish`` an unterminated body is a call when it already decodes, else content. A body that
starts with neither ``{`` / ``[`` nor ``<function=`` (prose naming the tag) is content at once.
"""

from __future__ import annotations

from .qwen3_coder import TOOL_CALL, Qwen3CoderToolParser


class HermesToolParser(Qwen3CoderToolParser):
    """Reads the JSON bodies above, and also Qwen3-Coder XML bodies (``<tool_call>`` then
    ``<function=``), which Qwen3-Coder emits although its config says ``qwen3_moe`` like the
    hermes-format Qwen3 models. Unlike ``qwen3_coder`` a bare ``<function=`` is content."""

    start_markers = (TOOL_CALL,)
