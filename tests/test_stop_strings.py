"""``resin.server.stop_strings``: a streamed choice's text cut at its first stop string.

The expected output is computed from whole texts: after each delta, the text so far is
searched for every stop string; the first time one is there, the earliest occurrence wins
(of two starting at one place, the one listed first), and the output ends before it (after it
with ``include_in_output``). The matcher must give that whatever the deltas are.
"""

from __future__ import annotations

import random

from resin.server.stop_strings import StopStringMatcher, StopStrings


def expected(deltas: list[str], stops: list[str], include: bool) -> tuple[str, str | None]:
    text = ""
    for delta in deltas:
        text += delta
        found = [(text.find(s), i, s) for i, s in enumerate(stops) if s and s in text]
        if found:
            at, _, stop = min(found)
            return text[: at + (len(stop) if include else 0)], stop
    return text, None


def test_random_texts_and_splits_match_the_whole_text_answer() -> None:
    rng = random.Random(0)
    for _ in range(5000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 4))) for _ in range(4)]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 24)))
        cuts = sorted(
            rng.sample(range(1, len(text)), min(max(len(text) - 1, 0), rng.randint(0, 8)))
        )
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] if text else []
        include = rng.random() < 0.5
        matcher = StopStringMatcher(stops, include)
        out = "".join(matcher.feed(d) for d in deltas) + matcher.flush()
        assert (out, matcher.matched) == expected(deltas, stops, include), (stops, deltas)


def test_a_partial_stop_string_is_held_until_it_resolves() -> None:
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("hello </e") == "hello "
    assert matcher.held == "</e"
    assert matcher.feed("xtra") == "</extra"
    assert matcher.feed(" </en") == " "
    assert matcher.feed("d> tail") == "" and matcher.matched == "</end>"
    assert matcher.feed("more") == "" and matcher.flush() == ""


def test_many_stop_strings_are_indexed_once_and_shared_by_choices() -> None:
    """A request's stop strings are indexed once for all its choices; 50,000 of them still
    find the one in the text, and the held tail is the longest pending prefix."""
    stops = [f"<stop{i}>" for i in range(50_000)]
    shared = StopStrings(stops + ["", stops[7]])
    assert len(shared.strings) == 50_000 and shared.max_len == len("<stop49999>")
    choices = [StopStringMatcher(shared) for _ in range(4)]
    for matcher in choices:
        assert matcher.feed("text <stop4") == "text "
        assert matcher.held == "<stop4"
        assert matcher.feed("2137> after") == "" and matcher.matched == "<stop42137>"
    assert StopStringMatcher(shared).feed("no stop <stopx>") == "no stop <stopx>"
