"""Marker search over streamed text: find the first whole marker, hold back a possible partial one.

A marker (``<tool_call>``, ``</think>``, ``<｜tool▁call▁begin｜>`` ...) can arrive split across
deltas, one character at a time. ``split_at_marker`` tells a parser what it may release now: the
text before the first whole marker, or, when there is none, everything but the longest tail that
is a proper prefix of some marker. Nothing more is held: ``"<b"`` is released at once because no
marker starts with it.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_first(text: str, markers: Sequence[str]) -> tuple[int, str]:
    """Index and marker of the earliest whole marker in ``text`` (longest on a tie); ``(-1, "")``."""
    best_at, best = -1, ""
    for marker in markers:
        at = text.find(marker)
        if at != -1 and (
            best_at == -1 or at < best_at or (at == best_at and len(marker) > len(best))
        ):
            best_at, best = at, marker
    return best_at, best


def partial_tail(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some marker."""
    longest = max((len(m) for m in markers), default=0)
    firsts = {m[0] for m in markers if m}
    for at in range(max(0, len(text) - longest + 1), len(text)):  # the longest tail first
        if text[at] in firsts:  # only a marker's first character starts a partial marker
            tail = text[at:]
            if any(m.startswith(tail) for m in markers):
                return len(text) - at
    return 0


def split_at_marker(text: str, markers: Sequence[str]) -> tuple[str, str | None, str]:
    """Split ``text`` at its first marker.

    Returns ``(before, marker, after)`` when a whole marker occurs, else ``(safe, None, held)``
    where ``held`` is the tail that may still become a marker and ``safe + held == text``.
    """
    at, marker = find_first(text, markers)
    if at != -1:
        return text[:at], marker, text[at + len(marker) :]
    keep = partial_tail(text, markers)
    return text[: len(text) - keep], None, text[len(text) - keep :]


def expect_marker(text: str, marker: str, final: bool) -> bool | None:
    """Whether ``text`` (after leading whitespace) starts with ``marker``.

    ``None`` means "cannot tell yet": the stripped text is still a prefix of the marker and more
    text may follow (never returned when ``final``).
    """
    stripped = text.lstrip()
    if stripped.startswith(marker):
        return True
    if not final and marker.startswith(stripped):
        return None
    return False
