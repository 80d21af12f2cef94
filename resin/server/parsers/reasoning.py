"""Splitting ``<think>...</think>`` reasoning from content (parsers ``qwen3``, ``deepseek_r1``, ``glm45``).

Rules (the same for any chunking of the text):

* ``<think>`` opens reasoning only at the very start of the output (after optional whitespace,
  which is dropped). Later ``<think>`` text is ordinary text.
* Reasoning runs until the first ``</think>``; everything after it is content, with no further
  marker handling. Nothing around the marker is stripped: like vLLM's ``qwen3`` / ``deepseek_r1``
  parsers (which return ``output.partition("</think>")`` pieces as they are), the ``"\\n\\n"``
  the model writes after ``</think>`` stays at the start of the content.
* With ``reasoning_started`` (the prompt ends inside ``<think>``, e.g. Qwen3-Thinking-2507 and
  DeepSeek-R1-0528 templates pre-fill ``<think>\\n``) the output is reasoning from its first
  character. ``deepseek_r1`` always behaves so: text before ``</think>`` is reasoning even without
  ``<think>`` (vLLM's R1 parser does the same; a whole output without ``</think>`` is reasoning).
* ``qwen3`` / ``glm45`` without ``<think>`` at the start: everything is content (a hybrid model
  with thinking switched off).
* An output that ends inside reasoning is all reasoning.
"""

from __future__ import annotations

from .events import ContentDelta, OutputEvent, ReasoningDelta
from .holdback import expect_marker, split_at_marker

THINK, THINK_END = "<think>", "</think>"


class ThinkReasoningParser:
    """``<think>...</think>`` at the start of the output is reasoning (``qwen3``, ``glm45``)."""

    implicit_start = False  # True: reasoning from the first character, without <think>

    def __init__(self, reasoning_started: bool = False) -> None:
        self._in_reasoning_first = reasoning_started or self.implicit_start
        self._state = "start"  # start -> reasoning -> content
        self._buf = ""

    def feed(self, text: str) -> list[OutputEvent]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[OutputEvent]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        if self._state == "start":
            found = expect_marker(self._buf, THINK, final)
            if found is None:
                return out  # empty, whitespace, or a partial "<think>" so far
            if found:
                self._buf = self._buf.lstrip()[len(THINK):]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self._in_reasoning_first else "content"
        if self._state == "reasoning":
            before, marker, after = split_at_marker(self._buf, (THINK_END,))
            if marker is None and final:
                before, after = self._buf, ""
            if before:
                out.append(ReasoningDelta(before))
            self._buf = after
            if marker is None:
                return out
            self._state = "content"
        if self._buf:
            out.append(ContentDelta(self._buf))
            self._buf = ""
        return out


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """Like ``ThinkReasoningParser``, but the output is reasoning until ``</think>`` even
    without ``<think>`` (``deepseek_r1``)."""

    implicit_start = True
