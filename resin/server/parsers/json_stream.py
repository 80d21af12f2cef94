"""``JsonObjectStreamer``: one JSON object arriving in pieces, re-emitted as soon as it is safe.

Tool-call arguments in the JSON formats (hermes, DeepSeek) are streamed through this instead of
being buffered until the call ends. It validates the object character by character and releases
normalized JSON text: separators become ``", "`` and ``": "``, whitespace between tokens is
dropped, strings are passed through as written (escapes checked; a raw control character, which
models sometimes put in strings, is escaped). String values stream as they arrive; a key is held
with its ``:`` (and the ``,`` before it) until its value starts; numbers and ``true`` /
``false`` / ``null`` are released when complete.

Guarantee: what has been released is always a prefix of a JSON object that ``close()`` completes
(closing an open string, then the open containers). So a call whose arguments break off (the
generation ended) or turn invalid (``error``) still ends with a JSON object: the valid part.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_SIMPLE_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")


class JsonObjectStreamer:
    """Feed text with ``feed``; read ``done`` / ``error``; ``close()`` completes an open object."""

    def __init__(self) -> None:
        self._stack: list[str] = []  # open containers, "{" or "["
        self._state = "start"
        self._held = ""  # released when the next value starts: ", " and/or '"key": '
        self._token = ""  # a number, literal or key being read
        self._escape = ""  # a partial escape sequence in a string
        self._in_key = False  # the string being read is a key (held), not a value (released)
        self._high = ""  # a high-surrogate escape (\\uD800-\\uDBFF) held for its low half
        self.done = False  # the object closed
        self.error = False  # an invalid character was met; nothing more is read

    @property
    def in_string(self) -> bool:
        """Whether the text so far ends inside a string (a key or a value)."""
        return self._state in ("string", "string_escape") and not self.error

    def feed(self, text: str) -> tuple[str, int]:
        """``(text to release, characters of text consumed)``.

        Consumption stops after the object's closing brace, or before the first invalid character.
        """
        out: list[str] = []
        at = 0
        while at < len(text) and not self.done and not self.error:
            if self._step(text[at], out):
                at += 1
        return "".join(out), at

    def close(self) -> str:
        """Text that completes what was released into a JSON object ("" when it is complete)."""
        if self.done:
            return ""
        if self._state == "start":
            self.done = True
            return "{}"
        tail = ""
        if self._state == "number" and _NUMBER.fullmatch(self._token):
            tail = self._held + self._token
        elif self._state in ("string", "string_escape") and not self._in_key:
            tail = '"'  # (a held high surrogate is dropped: alone it is not text)
        tail += "".join("}" if c == "{" else "]" for c in reversed(self._stack))
        self.done = True
        return tail

    # One character; True when it was consumed (False: look at it again in the new state).
    def _step(self, ch: str, out: list[str]) -> bool:
        state = self._state
        if state in ("string", "string_escape"):
            return self._string_char(ch, out)
        if state == "number":
            if ch in _NUMBER_CHARS:
                self._token += ch
                return True
            if not _NUMBER.fullmatch(self._token):
                self.error = True
                return False
            self._release(out, self._token)
            self._state = "after_value"
            return False
        if state == "literal":
            self._token += ch
            if self._token in _LITERALS:
                self._release(out, self._token)
                self._state = "after_value"
            elif not any(lit.startswith(self._token) for lit in _LITERALS):
                self._token = self._token[:-1]
                self.error = True
                return False
            return True
        if ch in " \t\r\n":
            return True
        if state == "start":
            if ch != "{":
                self.error = True
                return False
            self._open(ch, out)
        elif state in ("object_first", "object_key"):
            if ch == "}" and state == "object_first":
                self._close_container(out)
            elif ch == '"':
                self._token, self._in_key, self._state = "", True, "string"
            else:
                self.error = True
                return False
        elif state == "colon":
            if ch != ":":
                self.error = True
                return False
            self._held += '"' + self._token + '": '
            self._state = "value"
        elif state == "array_first" and ch == "]":
            self._close_container(out)
        elif state in ("value", "array_first"):
            return self._value_start(ch, out)
        elif state == "after_value":
            top = self._stack[-1]
            if ch == ",":
                self._held = ", "
                self._state = "object_key" if top == "{" else "value"
            elif (ch == "}" and top == "{") or (ch == "]" and top == "["):
                self._close_container(out)
            else:
                self.error = True
                return False
        return True

    def _value_start(self, ch: str, out: list[str]) -> bool:
        if ch == '"':
            self._release(out, '"')
            self._in_key, self._state = False, "string"
        elif ch in "{[":
            self._open(ch, out)
        elif ch == "-" or ch.isdigit():
            self._token, self._state = ch, "number"
        elif ch in "tfn":
            self._token, self._state = ch, "literal"
        else:
            self.error = True
            return False
        return True

    def _string_char(self, ch: str, out: list[str]) -> bool:
        if self._state == "string_escape":
            self._escape += ch
            if len(self._escape) == 2 and ch in _SIMPLE_ESCAPES:
                piece = self._escape
            elif (
                len(self._escape) >= 2
                and self._escape[1] == "u"
                and (len(self._escape) == 2 or ch in _HEX)
            ):
                if len(self._escape) < 6:
                    return True
                piece = self._surrogate_pair(self._escape)
                if not piece:  # a high surrogate: wait for its low half
                    self._escape, self._state = "", "string"
                    return True
            else:
                self._escape = ""
                self.error = True
                return False
            self._escape, self._state = "", "string"
        elif ch == "\\":
            self._escape, self._state = ch, "string_escape"
            return True
        elif ch == '"':
            piece = self._unpaired()
            if self._in_key:
                self._token += piece
                self._state = "colon"
            else:
                out.append(piece + '"')
                self._state = "after_value"
            return True
        elif ch < " ":
            piece = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(ch, f"\\u{ord(ch):04x}")
        else:
            piece = ch
        if self._high and not piece.startswith("\\u"):
            piece = self._unpaired() + piece
        if self._in_key:
            self._token += piece
        else:
            out.append(piece)
        return True

    def _surrogate_pair(self, escape: str) -> str:
        """What a complete ``\\uXXXX`` escape releases: "" for a high surrogate (held until its
        low half: a call cut between the two must not hand the client half a character, which
        no tokenizer takes back), the pair for a low surrogate after one, U+FFFD's escape for a
        surrogate without its other half."""
        code = int(escape[2:], 16)
        if 0xD800 <= code <= 0xDBFF:
            unpaired = self._unpaired()
            self._high = escape
            return unpaired  # "" unless a high surrogate was already held
        if 0xDC00 <= code <= 0xDFFF:
            if self._high:
                pair, self._high = self._high + escape, ""
                return pair
            return "\\ufffd"
        return self._unpaired() + escape

    def _unpaired(self) -> str:
        """U+FFFD's escape for a held high surrogate no low half followed ("" if none)."""
        if not self._high:
            return ""
        self._high = ""
        return "\\ufffd"

    def _release(self, out: list[str], text: str) -> None:
        out.append(self._held + text)
        self._held = ""

    def _open(self, ch: str, out: list[str]) -> None:
        self._release(out, ch)
        self._stack.append(ch)
        self._state = "object_first" if ch == "{" else "array_first"

    def _close_container(self, out: list[str]) -> None:
        self._held = ""
        out.append("}" if self._stack.pop() == "{" else "]")
        if self._stack:
            self._state = "after_value"
        else:
            self.done = True
