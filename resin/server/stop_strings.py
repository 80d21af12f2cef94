"""Stop strings for one streamed choice: find the first match, hold back a possible partial one.

``StopStringMatcher.feed(delta)`` returns the text that is safe to emit now. It keeps back the
longest tail of the text that is a proper prefix of some stop string (it may still turn into a
match), so a stop string split across tokens never reaches the client. When a stop string
appears, ``matched`` is set and the emitted text ends just before it (or just after it with
``include_in_output``, vLLM's ``include_stop_str_in_output``); later feeds return ``""``.
``flush()`` returns the held-back tail when the generation ends without a match.

The search only looks at the held tail plus the new delta (plus ``max_len - 1`` characters
before them), so the cost per delta is O(len(delta) + max stop length), not O(text so far).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    __slots__ = ("stops", "include_in_output", "held", "matched", "_max_len")

    def __init__(self, stops: Sequence[str], include_in_output: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_in_output = include_in_output
        self.held = ""  # text received but not yet emitted
        self.matched: str | None = None
        self._max_len = max((len(s) for s in self.stops), default=0)

    def feed(self, delta: str) -> str:
        if self.matched is not None:
            return ""
        if not self.stops:
            return delta
        text = self.held + delta
        first_at, first_stop = -1, ""
        for stop in self.stops:
            at = text.find(stop)
            if at != -1 and (first_at == -1 or at < first_at):
                first_at, first_stop = at, stop
        if first_at != -1:
            self.matched = first_stop
            self.held = ""
            end = first_at + (len(first_stop) if self.include_in_output else 0)
            return text[:end]
        keep = self._partial_tail(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for length in range(min(self._max_len - 1, len(text)), 0, -1):
            tail = text[len(text) - length :]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.matched is not None else held
