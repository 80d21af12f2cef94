"""One API request's generation: engine outputs → per-choice text deltas, stop strings, usage.

``Generator.start(request)`` adds the request's ``n`` choices to the :class:`EngineLoop`; the
returned :class:`Generation`'s ``deltas()`` yields lists of :class:`ChoiceDelta` — everything that arrived since the last yield, at most one
delta per choice (several engine steps are merged when the HTTP side falls behind, so a slow
client costs fewer, larger chunks, never lost tokens). Per choice it owns:

- incremental detokenization (``resin.tokenizer.IncrementalDetokenizer``: whole characters only);
- the stop token: when the engine stops on EOS / ``stop_token_ids``, that token counts in
  ``usage.completion_tokens`` but not in the text (vLLM's behaviour);
- stop strings (:class:`StopStringMatcher`): the text ends before the match, ``finish_reason``
  is ``"stop"``, ``stop_string`` names it, and the engine request is aborted at once;
- logprobs: the sampled token's logprob and the top ``num_top_logprobs``, with token text; a
  logprob that is not finite (a masked token) is reported as ``-9999.0``, as vLLM does, so
  every response stays valid JSON;
- prompt logprobs (``num_prompt_logprobs``): every prompt token's (None for the first) and the
  top k, with token text, on the choice's first delta.

When the consumer stops iterating early (a client disconnected, an exception), every unfinished
choice is aborted in ``finally`` — the pages go back to the pool at once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from resin._core import RequestOutput, SamplingParams
from resin.server.engine_loop import EngineLoop, RequestRejected
from resin.server.stop_strings import StopStringMatcher, StopStrings
from resin.structured_output import GrammarRegistry
from resin.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class TokenLogprob:
    """One token: its id, text and logprob, and the ``top`` alternatives. A prompt's first
    token has no logprob (None: nothing predicts it) and no alternatives."""

    token_id: int
    token: str
    logprob: float | None
    top: list[tuple[int, str, float]]


@dataclass(slots=True)
class ChoiceDelta:
    """New output of one choice. ``finish_reason`` is None while it runs, then ``"stop"``,
    ``"length"`` or ``"abort"``; ``stop_string`` is the matched stop string, if any."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_string: str | None = None
    # On a choice's first delta, when asked: one entry per prompt token, its logprob given the
    # tokens before it (None for the first).
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class GenerationRequest:
    """What to generate: ``params`` applies to every choice (choice ``i`` gets ``seed + i``)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    n: int = 1
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    num_top_logprobs: int | None = None  # None: no logprobs; 0: the sampled token's only
    num_prompt_logprobs: int | None = None  # the same, for the prompt's tokens
    grammar: Any = None  # a resin.structured_output.CompiledGrammar every choice must follow


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class _ChoiceState:
    __slots__ = (
        "index",
        "request_id",
        "detokenizer",
        "matcher",
        "num_tokens",
        "finished",
        "prompt_sent",
    )

    def __init__(
        self,
        index: int,
        request_id: str,
        detokenizer: IncrementalDetokenizer,
        matcher: StopStringMatcher,
    ) -> None:
        self.index = index
        self.request_id = request_id
        self.detokenizer = detokenizer
        self.matcher = matcher
        self.num_tokens = 0
        self.finished = False
        self.prompt_sent = False  # its prompt logprobs went out (when asked for)


class Generator:
    """Turns :class:`GenerationRequest` into streams of :class:`ChoiceDelta` via an EngineLoop."""

    def __init__(
        self, loop: EngineLoop, tokenizer: Tokenizer, grammars: GrammarRegistry | None = None
    ) -> None:
        self.loop = loop
        self.tokenizer = tokenizer
        self.grammars = grammars  # the runner's sampler reads request grammars from here
        self._ids = itertools.count()

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def start(self, request: GenerationRequest, request_id: str) -> Generation:
        """Queue the request's choices for the engine and return the :class:`Generation` to
        iterate (it raises ``RequestRejected`` if the engine refuses the request)."""
        return Generation(self, request, request_id)


class Generation:
    """One started API request: iterate :meth:`deltas`; ``usage`` fills in as it runs.
    Leaving the iteration early (or calling :meth:`abort`) aborts every unfinished choice."""

    def __init__(self, generator: Generator, request: GenerationRequest, request_id: str) -> None:
        self.loop = generator.loop
        self.tokenizer = generator.tokenizer
        self.request = request
        self.request_id = request_id
        self.usage = Usage(prompt_tokens=len(request.prompt_token_ids))
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (logprobs)
        self._token_bytes: dict[int, bytes] = {}  # token id -> its bytes, where not its text's
        ids = [request_id if request.n == 1 else f"{request_id}.{i}" for i in range(request.n)]
        base = request.params
        if request.grammar is not None:
            # the grammar decides where the output ends: a stop token banned by min_tokens, or
            # generation going on past it (ignore_eos), would break out of the grammar; and
            # no drafts (speculative decoding): the sampler masks plain rows, not verify rows
            base = _replace(base, min_tokens=0, ignore_eos=False, speculate=False)
        params = [base] + [_with_seed_offset(base, i) for i in range(1, request.n)]
        self._grammar_ids: list[str] = []
        if request.grammar is not None and generator.grammars is not None:
            self._grammars = generator.grammars
            for rid in ids:  # before the engine can schedule the request
                self._grammars.register(rid, request.grammar)
            self._grammar_ids = ids
        try:
            self._queue = self.loop.add(ids, request.prompt_token_ids, params)
        except BaseException:
            self._release_grammars()
            raise
        stops = StopStrings(request.stop)  # indexed once, shared by the n choices
        self._states = {
            rid: _ChoiceState(
                i,
                rid,
                self.tokenizer.incremental_detokenizer(
                    request.prompt_token_ids, request.skip_special_tokens
                ),
                StopStringMatcher(stops, request.include_stop_str_in_output),
            )
            for i, rid in enumerate(ids)
        }
        self._num_unfinished = len(ids)

    @property
    def finished(self) -> bool:
        return self._num_unfinished == 0

    def abort(self) -> None:
        if self._num_unfinished:
            self._num_unfinished = 0
            self.loop.abort(self._queue)
        self._release_grammars()

    def _release_grammars(self) -> None:
        for rid in self._grammar_ids:
            self._grammars.unregister(rid)
        self._grammar_ids = []

    async def deltas(self) -> AsyncIterator[list[ChoiceDelta]]:
        """Delta batches (at most one per choice, in choice order) until every choice ends.
        The outputs of several engine steps that arrived together are detokenized together."""
        try:
            while self._num_unfinished:
                groups: dict[str, list[RequestOutput]] = {}
                for output in await self._queue.drain():
                    groups.setdefault(output.request_id, []).append(output)
                self._check_grammars(groups)
                deltas: list[ChoiceDelta] = []
                for request_id, outputs in groups.items():
                    state = self._states[request_id]
                    if state.finished:
                        continue
                    deltas.append(self._advance(state, outputs))
                    if state.finished:
                        self._num_unfinished -= 1
                if deltas:
                    if len(deltas) > 1:
                        deltas.sort(key=lambda d: d.index)
                    yield deltas
        finally:
            self.abort()

    def _check_grammars(self, request_ids: Any) -> None:
        """RequestRejected (a 400) when the sampler reported that a choice's grammar could
        not follow its output (a grammar engine limit, such as llguidance's 2,000 items per
        parser row, reached only once generation is under way): the request fails rather than
        go on unconstrained, which would hand the client output its schema does not allow."""
        if not self._grammar_ids:
            return
        for request_id in request_ids:
            reason = self._grammars.failure(request_id)
            if reason is not None:
                raise RequestRejected(
                    f"structured output could not be enforced: {reason}. The request was "
                    "stopped rather than answered unconstrained; simplify the schema (fewer "
                    "tools or alternatives)"
                )

    def _advance(self, state: _ChoiceState, outputs: list[RequestOutput]) -> ChoiceDelta:
        """Fold one choice's new outputs (one per engine step, oldest first) into a delta. A
        stop string ends the choice at the token that completes it: tokens after it (a verify
        row's accepted drafts, later steps' outputs arriving together, the step already in
        flight) are dropped from the text, the token ids, the logprobs and the usage."""
        last = outputs[-1]
        if len(outputs) == 1:
            new_ids = last.new_token_ids
        else:
            new_ids = [t for output in outputs for t in output.new_token_ids]
        first_index = last.num_output_tokens - len(new_ids)  # the first new token's output index
        if state.index == 0:
            self.usage.cached_tokens = last.num_cached_tokens
        finish_reason = last.finish_reason if last.finished else None
        text_ids = new_ids[:-1] if finish_reason == "stop" and new_ids else new_ids
        text = ""
        if len(text_ids) > 1 and state.matcher.stops:  # token by token: where a match ends
            for i, token in enumerate(text_ids):
                text += state.matcher.feed(state.detokenizer.add_tokens([token]))
                if state.matcher.matched is not None:
                    new_ids = new_ids[: i + 1]
                    break
        elif text_ids:
            text = state.matcher.feed(state.detokenizer.add_tokens(text_ids))
        if state.matcher.matched is None and finish_reason is not None:
            text += state.matcher.feed(state.detokenizer.finish())
            text += state.matcher.flush()
        state.num_tokens += len(new_ids)
        self.usage.completion_tokens += len(new_ids)
        stop_string = state.matcher.matched
        if stop_string is not None:
            if finish_reason is None:
                self.loop.abort_request(state.request_id, stopped=True)
            finish_reason = "stop"
        state.finished = finish_reason is not None
        logprobs = None
        if self.request.num_top_logprobs is not None:
            logprobs = self._logprobs(last, first_index, new_ids, self.request.num_top_logprobs)
        delta = ChoiceDelta(state.index, text, list(new_ids), logprobs, finish_reason, stop_string)
        if self.request.num_prompt_logprobs is not None and not state.prompt_sent:
            state.prompt_sent = True
            delta.prompt_logprobs = self._prompt_logprobs(last, self.request.num_prompt_logprobs)
        return delta

    def _prompt_logprobs(self, output: RequestOutput, num_top: int) -> list[TokenLogprob]:
        prompt = self.request.prompt_token_ids
        entries = output.prompt_logprobs or []
        result = [TokenLogprob(prompt[0], self.token_text(prompt[0]), None, [])]
        for token_id, entry in zip(prompt[1:], entries[1:]):
            assert entry is not None  # only the first is None
            result.append(self._entry(token_id, entry, num_top))
        return result

    def _logprobs(
        self, output: RequestOutput, first_index: int, new_ids: list[int], num_top: int
    ) -> list[TokenLogprob]:
        # Only the new tokens' entries (from output index ``first_index``): the per-step cost
        # does not grow with the generation.
        entries = output.logprobs_from(first_index) or []
        return [self._entry(t, entry, num_top) for t, entry in zip(new_ids, entries)]

    def _entry(self, token_id: int, entry: dict[int, float], num_top: int) -> TokenLogprob:
        """``token_id``'s logprob and the ``num_top`` best of ``entry``, with their texts."""
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:num_top]
        return TokenLogprob(
            token_id,
            self.token_text(token_id),
            _finite(entry.get(token_id, MIN_LOGPROB)),
            [(int(t), self.token_text(int(t)), _finite(lp)) for t, lp in top],
        )

    def token_bytes(self, token_id: int, text: str) -> bytes:
        """A token's bytes (chat logprobs' ``bytes``): its text's UTF-8, or, for a token
        holding part of a character (text U+FFFD), its own bytes
        (:meth:`resin.tokenizer.Tokenizer.token_bytes`), so a client can join them."""
        if "\ufffd" not in text:
            return text.encode()
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = self._token_bytes[token_id] = self.tokenizer.token_bytes(token_id)
        return raw

    def token_text(self, token_id: int) -> str:
        """A token's text alone, decoded once per token id a request meets."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text


MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    value = float(logprob)
    return value if math.isfinite(value) else MIN_LOGPROB


def _with_seed_offset(params: SamplingParams, offset: int) -> SamplingParams:
    if params.seed is None:
        return params
    return _replace(params, seed=(params.seed + offset) % 2**63)  # a non-negative int64


def _replace(params: SamplingParams, **changes: Any) -> SamplingParams:
    # every public attribute of SamplingParams is a constructor field (no methods), so the
    # copy cannot fall behind when a field is added
    fields = {name: getattr(params, name) for name in dir(params) if not name.startswith("_")}
    fields.update(changes)
    return SamplingParams(**fields)
