"""DeepSeek-V3.2 / V4 DSML tool calls (parser ``deepseek_dsml``, aliases ``deepseek_v32``,
``deepseek_v4``; the bars are U+FF5C)::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">北京</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

The outer tag is ``function_calls`` (V3.2), ``tool_calls`` (V4) or ``calls`` (V4.1, which also
writes a space after ``｜DSML｜`` in every tag name: ``<｜DSML｜ invoke name=...>``); any of them is
read for any model, with or without that space, and whitespace between tags is ignored. Each
``invoke`` is one call. A parameter with ``string="true"`` is its raw text, verbatim, streamed as
it arrives; with ``string="false"`` it is JSON (number, boolean, object, array, null), sent once
complete, and when it does not decode it is converted by the tool's schema
(``schema.convert_value``: a Python literal for an object, ...) or else kept as the raw string;
without the attribute it is typed by the schema as the XML formats are. An invoke whose body is a
JSON object (``<｜DSML｜invoke name="f">{"a": 1}</｜DSML｜invoke>``, which SGLang accepts too)
streams that object. The older DeepSeek body shapes (``<｜tool▁call▁begin｜>...``: V3.2-Exp has the
``deepseek_v32`` model type and writes the V3.1 shape) are read as ``deepseek_v31`` reads them.

Where a value ends: at the first DSML tag (``<｜DSML｜`` or ``</｜DSML｜``); ``｜DSML｜`` is no text a
value holds. ``</｜DSML｜parameter>`` closes it; any other tag (the next parameter, the invoke's
end) means its end tag was forgotten, and is read as structure. A parameter given twice keeps its
first value; text between parameters is ignored.

Leniency, decided as text arrives (so any split gives the same result): an invoke without the
outer block is a call; a missing ``</｜DSML｜invoke>`` is closed by the next invoke, the block's end
or the end of the output (with the parameters read so far; a value cut off keeps its partial
text). The block's markers are structure only once a call forms inside it: a block whose first
non-blank text is not an invoke with a function name (``tool_parser.is_function_name``), or that
ends without one, goes out as text, markers included. After a call, text in the block that is not
a tag ends the block (it is content), and stray end tags are dropped. A ``<｜DSML｜`` that does not
open a well-formed tag is text.

The parser is generic over its markers (class attributes: the markers that begin a tag in
content and inside a block, the prefixes before a tag's name, the block's names, DeepSeek's V3
markers or none): MiniMax-M2's ``<minimax:tool_call>`` / ``<invoke name=...>`` /
``<parameter name=...>`` format has this structure and subclasses it (``minimax_m2.py``).
Attribute values are quoted with ``"`` (or ``'``).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from .deepseek import CALL_BEGIN, CALLS_BEGIN, CALLS_END, DeepSeekToolParser
from .events import OutputEvent
from .holdback import split_at_marker
from .json_stream import JsonObjectStreamer
from .schema import convert_value, loads_finite
from .tool_parser import MAX_NAME, is_function_name

DSML = "｜DSML｜"
OPEN, CLOSE = "<" + DSML, "</" + DSML
BLOCK_NAMES = frozenset({"function_calls", "tool_calls", "calls"})
INVOKE, PARAMETER = "invoke", "parameter"
MAX_TAG = 2 * MAX_NAME + 64  # longest text between a DSML marker and its ">"

_VALUE = r""""[^"<>\n]*"|'[^'<>\n]*'"""
_NAME = r"[A-Za-z_][\w:]*"  # a tag's name (MiniMax's block is minimax:tool_call)
# A tag after its marker: name, then name="value" attributes.
_TAG = re.compile(
    r"\s*(?P<name>" + _NAME + r")(?P<attrs>(?:\s+[A-Za-z_][\w-]*\s*=\s*(?:" + _VALUE + r"))*)\s*"
)
# A tag still arriving: a prefix of the above.
_TAG_PREFIX = re.compile(
    r"\s*(?:"
    + _NAME
    + r"(?:\s+[A-Za-z_][\w-]*\s*=\s*(?:"
    + _VALUE
    + r"""))*(?:\s+(?:[A-Za-z_][\w-]*\s*(?:=\s*(?:"[^"<>\n]*|'[^'<>\n]*)?)?)?)?)?"""
)
_ATTR = re.compile(r"""([A-Za-z_][\w-]*)\s*=\s*(?:"([^"]*)"|'([^']*)')""")

Tag = tuple[str, dict[str, str], int]  # name, attributes, length up to and including ">"


def read_tag(text: str, final: bool) -> Tag | Literal[False] | None:
    """The tag at the start of ``text`` (its ``<｜DSML｜`` / ``</｜DSML｜`` already read): ``None``
    while more text may still make one, ``False`` when it is not one."""
    gt = text.find(">", 0, MAX_TAG + 1)
    if gt == -1:
        if final or len(text) > MAX_TAG or not _TAG_PREFIX.fullmatch(text):
            return False
        return None
    match = _TAG.fullmatch(text, 0, gt)
    if match is None:
        return False
    attrs = {key: double or single for key, double, single in _ATTR.findall(match.group("attrs"))}
    return match.group("name"), attrs, gt + 1


class DsmlToolParser(DeepSeekToolParser):
    """DSML, and any format of its structure by its markers (see the module doc)."""

    reasoning_exit_markers: tuple[str, ...] = (CALLS_BEGIN, CALL_BEGIN, OPEN)
    # DeepSeek's V3 / V3.1 markers, read in content as deepseek_v31 reads them (none: not read).
    deepseek_markers: tuple[str, ...] = (CALL_BEGIN, CALLS_BEGIN, CALLS_END)
    # Markers that begin a tag in content (a block, a bare invoke, a stray end tag) and inside a
    # block or an invoke (where they also end a value). Each begins with ``tag_open`` or
    # ``tag_close`` (the end tags'); the rest of the marker is read as the tag.
    content_tag_markers: tuple[str, ...] = (OPEN, CLOSE)
    tag_markers: tuple[str, ...] = (OPEN, CLOSE)
    tag_open, tag_close = OPEN, CLOSE
    block_names: frozenset[str] = BLOCK_NAMES
    _dsml_block = False  # inside <｜DSML｜function_calls> (or tool_calls / calls)
    _block_start = 0  # num_calls when the block (or a bare invoke) began
    _body_started = False  # the invoke's body has had non-blank text
    _param = ""  # the parameter being read
    _pflag: str | None = None  # its string="..." attribute
    _vstream = False  # its value streams as a JSON string
    _vparts: list[str] = []  # its text so far (when not streamed)

    # -- content -----------------------------------------------------------------------------

    def _at_tag(self, marker: str, after: str) -> str:
        """A tag ``marker`` was found before ``after``: its rest (past its ``tag_open`` /
        ``tag_close`` prefix) goes back to the buffer to be read as the tag. Returns the prefix."""
        prefix = self.tag_close if marker.startswith(self.tag_close) else self.tag_open
        self._buf = marker[len(prefix) :] + after
        return prefix

    def _tag_state(self, prefix: str, open_state: str, close_state: str) -> str:
        return close_state if prefix == self.tag_close else open_state

    def _step_content(self, out: list[OutputEvent], final: bool) -> bool:
        markers = self.deepseek_markers + self.content_tag_markers
        before, marker, after = split_at_marker(self._buf, markers)
        if marker is None:
            self._content(out, self._buf if final else before)
            self._buf = "" if final else after
            return False
        if marker in self.deepseek_markers:
            return super()._step_content(out, final)  # finds the same (DeepSeek V3) marker
        self._content(out, before)
        self._scan_from = 0
        self._raw = self._at_tag(marker, after)
        self._block_start = self.num_calls
        self._state = self._tag_state(self._raw, "tag", "close_tag")
        return True

    def _fallback(self, out: list[OutputEvent], rest: str = "") -> bool:
        self._dsml_block = False
        return super()._fallback(out, rest)

    def _consume(self, length: int) -> None:
        """Read structure: kept in ``_raw`` (the text since the last call, or since the block
        began) for the fallback to content."""
        self._raw += self._buf[:length]
        self._buf = self._buf[length:]

    def _structure(self) -> None:
        """A tag was read as structure: after a call, it is never given back as text."""
        if self.num_calls > self._block_start:
            self._raw = ""

    # -- the block ---------------------------------------------------------------------------

    def _step_tag(self, out: list[OutputEvent], final: bool) -> bool:
        """After ``<｜DSML｜`` outside an invoke: a block or an invoke opens, else text."""
        tag = read_tag(self._buf, final)
        if tag is None:
            return False
        if tag is False:
            return self._fallback(out)
        name, attrs, end = tag
        if name in self.block_names and not attrs:
            self._consume(end)  # a second block open inside a block is dropped
            self._structure()
            self._dsml_block = True
            self._state = "block"
            return True
        if name == INVOKE:
            return self._open_invoke(out, attrs, end)
        return self._fallback(out)

    def _step_close_tag(self, out: list[OutputEvent], final: bool) -> bool:
        """After ``</｜DSML｜`` outside an invoke: the block's end, or a stray end tag."""
        tag = read_tag(self._buf, final)
        if tag is None:
            return False
        if tag is False or tag[1]:
            return self._fallback(out)
        name, _, end = tag
        if name not in self.block_names and name not in (INVOKE, PARAMETER):
            return self._fallback(out)
        formed = self.num_calls > self._block_start
        if name in self.block_names and self._dsml_block:
            self._consume(end)
            if not formed:
                return self._fallback(out)  # no call in the block: all of it is text
            self._dsml_block = False
            self._raw = ""
            self._state = "content"
        elif self._dsml_block:
            self._consume(end)  # a stray </｜DSML｜invoke> in the block
            self._structure()
            self._state = "block"
        elif self.num_calls:
            self._buf = self._buf[end:]  # a stray end tag after the calls
            self._raw = ""
            self._state = "content"
        else:
            return self._fallback(out)
        return True

    def _step_block(self, out: list[OutputEvent], final: bool) -> bool:
        """Between invokes (in the block, or after a bare invoke)."""
        stripped = self._buf.lstrip()
        self._consume(len(self._buf) - len(stripped))
        for marker in self.tag_markers:
            if stripped.startswith(marker):
                prefix = self.tag_close if marker.startswith(self.tag_close) else self.tag_open
                self._consume(len(prefix))
                self._state = self._tag_state(prefix, "tag", "close_tag")
                return True
        if not final and (not stripped or any(m.startswith(stripped) for m in self.tag_markers)):
            return False
        # Not a tag: before any call the block was text; after one, the text ends the block.
        return self._fallback(out)

    # -- one invoke --------------------------------------------------------------------------

    def _open_invoke(self, out: list[OutputEvent], attrs: dict[str, str], end: int) -> bool:
        name = attrs.get("name", "").strip()
        if not is_function_name(name, self.schemas):
            return self._fallback(out)  # the rest is scanned again as content
        self._buf = self._buf[end:]
        self._start_call(out, name)
        self._tool = name
        self._body_started = False
        self._state = "invoke"
        return True

    def _end_invoke(self, out: list[OutputEvent]) -> None:
        self._close_params(out)
        self._raw = ""
        self._state = "block"

    def _step_invoke(self, out: list[OutputEvent], final: bool) -> bool:
        """Inside an invoke: parameters (or one JSON object) until a tag ends it."""
        if not self._body_started:
            stripped = self._buf.lstrip()
            if stripped:
                self._body_started = True
                if stripped.startswith("{"):
                    self._buf = stripped
                    self._streamer = JsonObjectStreamer()
                    self._leftover = ""
                    self._state = "json_args"
                    return True
        _, marker, after = split_at_marker(self._buf, self.tag_markers)
        if marker is None:
            if not final:
                self._buf = after  # text between parameters is ignored; keep a partial tag
                return False
            self._buf = ""
            self._end_invoke(out)
            return True
        self._state = self._tag_state(self._at_tag(marker, after), "param_open", "invoke_close")
        return True

    def _step_param_open(self, out: list[OutputEvent], final: bool) -> bool:
        """After ``<｜DSML｜`` in an invoke: a parameter, or the next invoke / block."""
        tag = read_tag(self._buf, final)
        if tag is None:
            return False
        if tag is False:
            self._state = "invoke"  # not a tag: ignored, as text between parameters
            return True
        name, attrs, end = tag
        if name == PARAMETER and attrs.get("name", "").strip():
            self._buf = self._buf[end:]
            flag = attrs.get("string")
            self._open_param(out, attrs["name"].strip(), flag and flag.strip().lower())
            return True
        if name == INVOKE or name in self.block_names:
            self._end_invoke(out)  # the next call began before this one was closed
            self._raw = self.tag_open
            self._block_start = self.num_calls
            if name == INVOKE:
                return self._open_invoke(out, attrs, end)
            self._consume(end)
            self._dsml_block = True
            return True
        self._state = "invoke"
        return True

    def _step_invoke_close(self, out: list[OutputEvent], final: bool) -> bool:
        """After ``</｜DSML｜`` in an invoke: its end (or the block's), else ignored."""
        tag = read_tag(self._buf, final)
        if tag is None:
            return False
        if tag is False or tag[1]:
            self._state = "invoke"
            return True
        name, _, end = tag
        if name == INVOKE:
            self._buf = self._buf[end:]
            self._end_invoke(out)
        elif name in self.block_names:
            self._buf = self._buf[end:]
            self._end_invoke(out)  # </｜DSML｜invoke> forgotten
            self._dsml_block = False
            self._state = "content"
        else:
            if name == PARAMETER:
                self._buf = self._buf[end:]  # a stray </｜DSML｜parameter>
            self._state = "invoke"
        return True

    # -- one parameter -----------------------------------------------------------------------

    def _open_param(self, out: list[OutputEvent], key: str, flag: str | None) -> None:
        self._param, self._pflag, self._vparts = key, flag, []
        self._skip_param = key in self._seen_keys
        if flag == "true":
            self._vstream = not self._skip_param
        elif flag == "false":
            self._vstream = False
        else:
            self._vstream = self._param_streams(key)
        if self._vstream:
            self._open_string_param(out, key)
        self._state = "param_value"

    def _step_param_value(self, out: list[OutputEvent], final: bool) -> bool:
        """A value, up to the next DSML marker (see the module doc)."""
        before, marker, after = split_at_marker(self._buf, self.tag_markers)
        if marker is None and final:
            before, after = self._buf, ""
        if self._skip_param:
            pass  # a parameter the call already has
        elif self._vstream:
            self._string_param_text(out, before)
        else:
            self._vparts.append(before)
        self._buf = after
        if marker is None and not final:
            return False
        if self._skip_param:
            pass
        elif self._vstream:
            self._close_string_param(out)
        else:
            self._add_param(out, self._param, self._convert("".join(self._vparts)))
        self._vparts = []
        # The tag that ended the value is read as structure (its own end, or the next tag).
        if marker is None:
            self._state = "invoke"
        else:
            prefix = self._at_tag(marker, after)
            self._state = self._tag_state(prefix, "param_open", "invoke_close")
        return True

    def _convert(self, raw: str) -> Any:
        schema = self.param_schema(self._tool, self._param)
        if self._pflag == "false":
            ok, value = loads_finite(raw)
            if ok:
                return value
        return convert_value(raw, schema)

    # -- a JSON body -------------------------------------------------------------------------

    def _step_json_args(self, out: list[OutputEvent], final: bool) -> bool:
        """An invoke whose body is a JSON object, streamed up to the next DSML tag; text after
        an invalid character goes out as content after the call."""
        before, marker, after = split_at_marker(self._buf, self.tag_markers)
        if marker is None and final:
            before, after = self._buf, ""
        self._feed_arguments(out, before)
        if marker is None and not final:
            self._buf = after
            return False
        self._args(out, self._streamer.close())
        self._end_call(out, cut=self._streamer.error)
        self._content(out, self._leftover)
        self._leftover = ""
        self._raw = ""
        self._buf = (marker or "") + after  # its </｜DSML｜invoke>: a stray end tag now
        self._state = "block"
        return True
