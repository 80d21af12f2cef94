"""MiniMax-M2 tool calls (parser ``minimax_m2``, as vLLM names it; MiniMax-M2 / M2.1 / M2.5)::

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Oslo</parameter>
    <parameter name="days">2</parameter>
    </invoke>
    </minimax:tool_call>

DSML's structure under other markers (:class:`DsmlToolParser`, made generic over them): a block
of invokes, each one call, each parameter a named tag. A block holds one or more invokes, and an
output may hold several blocks. The values carry no type attribute: each is typed by the tool's
JSON schema (``schema.convert_value``: a string parameter, or one the schema does not declare, is
its raw text, verbatim, streamed as it arrives; a number, boolean, object or array is converted
once complete, a Python literal for an object, ...; text that does not convert is kept as the
raw string), as the other XML formats do. MiniMax's template writes values between their tags
with no newline around them, so a string is kept as written (vLLM's parser strips whitespace
around every value; here a file's trailing newline survives). Names may be quoted with ``"`` or
``'``.

Where a value ends: at the first MiniMax tag, ``</parameter>`` (its end), or, its end tag
forgotten, ``<parameter name=``, ``</invoke>``, ``<invoke name=``, ``<minimax:tool_call>`` or
``</minimax:tool_call>``; any other ``<`` (code, markup) is text of the value.

Only ``<minimax:tool_call>`` starts calls: an ``<invoke name=...>`` in plain content is text. The
rest of the leniency is DSML's, decided as text arrives (so any split gives the same result): a
missing ``</invoke>`` is closed by the next invoke, the block's end or the end of the output
(with the parameters read so far; a value cut off keeps its partial text); a block whose first
non-blank text is not an invoke with a function name, or that ends without a call, goes out as
text, markers included; after a call, text in the block that is not a tag ends the block (it is
content), and stray end tags are dropped; a parameter given twice keeps its first value; an
invoke whose body is a JSON object streams that object.

The markers are not special tokens in MiniMax's tokenizer (added tokens with ``special`` false:
vLLM's parser reads them from the detokenized text with the default ``skip_special_tokens``), so
the server needs no ``needs_special_tokens`` here. Reasoning is ``<think>...</think>`` (parser
``qwen3``): MiniMax's template ends the prompt with ``<think>\\n``, so the output is reasoning
until ``</think>`` (``ChatPrompt.reasoning_started``).
"""

from __future__ import annotations

from .dsml import DsmlToolParser

BLOCK = "minimax:tool_call"
TOOL_CALL, TOOL_CALL_END = f"<{BLOCK}>", f"</{BLOCK}>"
INVOKE, INVOKE_END = "<invoke name=", "</invoke>"
PARAMETER, PARAMETER_END = "<parameter name=", "</parameter>"


class MiniMaxM2ToolParser(DsmlToolParser):
    start_markers = (TOOL_CALL,)
    reasoning_exit_markers = (TOOL_CALL,)
    deepseek_markers = ()
    content_tag_markers = (TOOL_CALL, TOOL_CALL_END)
    tag_markers = (TOOL_CALL, TOOL_CALL_END, INVOKE, INVOKE_END, PARAMETER, PARAMETER_END)
    tag_open, tag_close = "<", "</"
    block_names = frozenset({BLOCK})
