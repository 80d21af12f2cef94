"""Splitting ``<think>...</think>`` reasoning from content (parsers ``qwen3``, ``deepseek_r1``,
``deepseek_v3``, ``deepseek_v4``, ``glm45``).

Rules (the same for any chunking of the text):

* ``<think>`` opens reasoning only at the very start of the output (after optional whitespace,
  which is dropped). Later ``<think>`` text is ordinary text.
* Reasoning runs until the first ``</think>``; everything after it is content, with no further
  marker handling. Nothing around the marker is stripped: like vLLM's ``qwen3`` / ``deepseek_r1``
  parsers (which return ``output.partition("</think>")`` pieces as they are), the ``"\\n\\n"``
  the model writes after ``</think>`` stays at the start of the content.
* With ``reasoning_started`` (the prompt ends inside ``<think>``, e.g. Qwen3-Thinking-2507,
  DeepSeek-R1-0528 and DeepSeek-V3.1/3.2 thinking templates pre-fill ``<think>``) the output is
  reasoning from its first character. ``deepseek_r1`` always behaves so: text before
  ``</think>`` is reasoning even without ``<think>`` (vLLM's R1 parser does the same; a whole
  output without ``</think>`` is reasoning). ``deepseek_v3`` is ``qwen3``'s rule under
  DeepSeek's name (vLLM and SGLang register one too): DeepSeek-V3 does not think, so its
  output is content unless it opens ``<think>`` or the template pre-filled it.
* ``qwen3`` / ``glm45`` / ``deepseek_v3`` without ``<think>`` at the start: everything is
  content (a hybrid model with thinking switched off).
* An output that ends inside reasoning is all reasoning, except for a tool call (below).

Tool calls and reasoning (when the request has tools, ``OutputParser`` passes the tool parser's
class as ``tool_parser``). A call inside a *closed* ``<think>...</think>`` block stays
reasoning: it is not promoted to a call. vLLM never looks for calls in reasoning, and SGLang
(non-streaming) splits at ``</think>`` before its tool parser runs too, so they agree; a model
that drafts a call while thinking and then closes the block has not made it. A model that opens
a call *without* closing its reasoning (Qwen3.5 and GLM do: ``<think>...<tool_call>...``) has
ended its reasoning there, as SGLang's ``tool_start_token`` rule says (for ``<tool_call>``,
Kimi's ``<|tool_calls_section_begin|>``): the call start marker ends the reasoning if no
``</think>`` follows. Which of the two it is is only known at the ``</think>`` or at the end, so
from a call start marker (``ToolParser.exit_markers``) on, reasoning text is held:

* a ``</think>`` arrives: the held text was reasoning (released as such);
* a trial tool parser fed the held text (one character at a time, so the decision does not
  depend on the chunking) returns to plain content without a call (the marker was prose, say
  ``<tool_call> tags``): the held text is reasoning, released at once, and the scan goes on;
* the output ends: if the held text makes a call, it is content (the tool parser reads it);
  else reasoning.
"""

from __future__ import annotations

from .events import ContentDelta, OutputEvent, ReasoningDelta
from .holdback import expect_marker, partial_tail, split_at_marker
from .tool_parser import ToolParser

THINK, THINK_END = "<think>", "</think>"


class ThinkReasoningParser:
    """``<think>...</think>`` at the start of the output is reasoning (``qwen3``, ``glm45``,
    ``deepseek_v3``, ``deepseek_v4``)."""

    implicit_start = False  # True: reasoning from the first character, without <think>

    def __init__(
        self,
        reasoning_started: bool = False,
        tool_parser: type[ToolParser] | None = None,
        tools: list[dict] | None = None,
    ) -> None:
        self._in_reasoning_first = reasoning_started or self.implicit_start
        self._state = "start"  # start -> reasoning (<-> held) -> content
        self._buf = ""
        self._tool_parser = tool_parser
        self._tools = tools
        self._exit_markers: tuple[str, ...] = tool_parser.exit_markers() if tool_parser else ()
        self._trial: ToolParser | None = None  # the tool parser fed the held text ("held")
        self._held: list[str] = []  # reasoning text from a call start marker on (state "held")
        self._tail = ""  # its last characters, where a "</think>" may be arriving

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
                self._buf = self._buf.lstrip()[len(THINK) :]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self._in_reasoning_first else "content"
        while self._state in ("reasoning", "held"):
            if self._state == "held" and not self._step_held(out, final):
                return out
            if self._state != "reasoning":
                continue
            before, marker, after = split_at_marker(self._buf, (THINK_END, *self._exit_markers))
            if marker is None and final:
                before, after = self._buf, ""
            if before:
                out.append(ReasoningDelta(before))
            self._buf = after
            if marker is None:
                return out
            if marker == THINK_END:
                self._state = "content"
            else:
                self._state = "held"
                assert self._tool_parser is not None  # exit markers come from it
                self._trial = self._tool_parser(self._tools)
                self._trial.feed(marker)
                self._hold(marker)
        if self._buf:
            out.append(ContentDelta(self._buf))
            self._buf = ""
        return out

    def _step_held(self, out: list[OutputEvent], final: bool) -> bool:
        """Feed the held text on; True when the state changed (go on), False to wait."""
        trial = self._trial
        assert trial is not None  # set when the state became "held"
        buf, self._buf = self._buf, ""
        at = 0
        while at < len(buf):
            if trial.num_calls:
                # A call has started, so the marker can no longer be rejected: only a
                # </think> matters, and the trial takes the rest in one piece.
                probe = self._tail + buf[at:]
                found = probe.find(THINK_END)
                if found == -1:
                    self._hold(buf[at:])
                    trial.feed(buf[at:])
                    break
                cut = at + found - len(self._tail) + len(THINK_END)
                self._hold(buf[at:cut])
                return self._close_held(out, buf[cut:])
            ch = buf[at]
            at += 1
            closes = (self._tail + ch).endswith(THINK_END)
            self._hold(ch)
            if closes:
                return self._close_held(out, buf[at:])
            trial.feed(ch)
            if trial.in_plain_content():  # the marker was not a call: reasoning
                held = "".join(self._held)
                # Scanned again as reasoning: a partial marker the trial still holds, or the
                # start of a "</think>" that the trial took as text.
                pending = max(trial.held_back(), partial_tail(held, (THINK_END,)))
                if len(held) > pending:
                    out.append(ReasoningDelta(held[: len(held) - pending]))
                self._buf = held[len(held) - pending :] + buf[at:]
                self._held, self._tail, self._trial = [], "", None
                self._state = "reasoning"
                return True
        if not final:
            return False
        trial.finish()
        held = "".join(self._held)
        if held:  # a call start the output never closed reasoning after
            out.append((ContentDelta if trial.num_calls else ReasoningDelta)(held))
        self._held, self._tail, self._trial = [], "", None
        self._state = "content"
        return True

    def _hold(self, text: str) -> None:
        self._held.append(text)
        self._tail = (self._tail + text)[-(len(THINK_END) - 1) :]

    def _close_held(self, out: list[OutputEvent], rest: str) -> bool:
        """The held text ends with ``</think>``: it was all reasoning; ``rest`` is content."""
        held = "".join(self._held)
        out.append(ReasoningDelta(held[: -len(THINK_END)]))
        self._held, self._tail, self._trial, self._buf = [], "", None, rest
        self._state = "content"
        return True


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """Like ``ThinkReasoningParser``, but the output is reasoning until ``</think>`` even
    without ``<think>`` (``deepseek_r1``)."""

    implicit_start = True
