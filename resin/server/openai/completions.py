"""``POST /v1/completions``: the legacy OpenAI Completions API, streaming and not (conformance §1).

``prompt`` may be a string, a list of strings, a list of token ids or a list of token-id lists
(vllm/sglang benchmarks send token ids). Each prompt gets ``n`` choices, numbered
``prompt_index * n + j`` as vLLM does; ``max_tokens`` defaults to 16 (OpenAI's default);
``echo`` prepends the prompt text; ``logprobs`` (0–5) uses the legacy shape (``tokens``,
``token_logprobs``, ``top_logprobs`` as ``{token: logprob}``, ``text_offset``). With both, the
prompt's tokens come first in that shape (the first with a null logprob: nothing predicts it),
each its logprob given the tokens before it — what lm-evaluation-harness scores answers with;
``max_tokens: 0`` with ``echo`` scores the prompt alone (one token is computed and dropped).
Several prompts run concurrently; their streams are merged as chunks arrive.

vLLM's ``return_token_ids: true`` adds ``prompt_token_ids`` and ``token_ids`` (the completion's
ids, the stop token included) to each choice; in a stream, ``prompt_token_ids`` comes on each
choice's first chunk and ``token_ids`` on every chunk holds its new ids.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from resin.server.context import ServerContext
from resin.server.errors import APIError, context_length_exceeded, openai_stream_error
from resin.server.generation import (
    ChoiceDelta,
    Generation,
    GenerationRequest,
    TokenLogprob,
    Usage,
)
from resin.server.ids import random_id
from resin.server.openai.chat import check_stream_fields, usage_body
from resin.server.request_fields import get_bool, get_dict, get_int, get_stop
from resin.server.sampling_request import max_tokens_for, sampling_params
from resin.server.sse import DONE, data_event, dumps

DEFAULT_MAX_TOKENS = 16
MAX_LEGACY_LOGPROBS = 5


def parse_prompts(ctx: ServerContext, value: Any) -> list[tuple[str, list[int]]]:
    """(text, token ids) per prompt."""

    def is_ids(v: Any) -> bool:
        return (
            isinstance(v, list)
            and bool(v)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
        )

    if isinstance(value, str):
        items: list[Any] = [value]
    elif is_ids(value):
        items = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) or is_ids(v) for v in value):
        items = value
    else:
        raise APIError(
            400,
            "'prompt' must be a string, an array of strings, an array of token "
            "ids or an array of token-id arrays, and not empty",
            param="prompt",
        )
    prompts = []
    vocab_size = ctx.tokenizer.vocab_size
    for item in items:
        if isinstance(item, str):
            ctx.check_prompt_text(item, param="prompt")
            token_ids = ctx.encode(item)
            if not token_ids:
                raise APIError(400, "'prompt' is empty: it has no tokens", param="prompt")
            prompts.append((item, token_ids))
        else:
            if len(item) >= ctx.max_model_len:  # before decoding a huge id list
                raise context_length_exceeded(ctx.max_model_len, len(item), None, param="prompt")
            bad = [t for t in item if t < 0 or t >= vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"'prompt' has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                    param="prompt",
                )
            prompts.append((ctx.tokenizer.decode(item), list(item)))
    return prompts


def legacy_logprobs(entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy shape of ``entries`` whose text starts at character ``offset``; an entry
    without a logprob (a prompt's first token) has null ``token_logprobs`` and
    ``top_logprobs`` entries, as OpenAI and vLLM write them."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for entry in entries:
        tokens.append(entry.token)
        token_logprobs.append(entry.logprob)
        top.append(None if entry.logprob is None else {t: lp for _, t, lp in entry.top})
        text_offset.append(offset)
        offset += len(entry.token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": text_offset,
    }


class CompletionRequest:
    """A validated completions request: one :class:`GenerationRequest` per prompt."""

    def __init__(self, ctx: ServerContext, body: dict[str, Any]) -> None:
        self.model = ctx.check_model(body.get("model"))
        check_stream_fields(body)
        if body.get("suffix"):
            raise APIError(400, "'suffix' is not supported", param="suffix")
        self.prompts = parse_prompts(ctx, body.get("prompt"))
        self.n = get_int(body, "n", 1, minimum=1, maximum=128) or 1
        self.echo = get_bool(body, "echo", False)
        logprobs = get_int(body, "logprobs", minimum=0, maximum=MAX_LEGACY_LOGPROBS)
        self.num_logprobs = logprobs
        # echo + logprobs: the prompt's tokens' logprobs too (OpenAI's legacy behaviour)
        prompt_logprobs = logprobs if self.echo else None
        requested = get_int(body, "max_tokens", minimum=0)
        # max_tokens 0 with echo scores the prompt: one token is computed and dropped
        self.score_only = requested == 0
        if self.score_only:
            if not self.echo:
                raise APIError(
                    400, "'max_tokens' must be at least 1 (0 only with 'echo')", param="max_tokens"
                )
            requested = 1
        stop = get_stop(body, "stop")
        self.return_token_ids = get_bool(body, "return_token_ids", False)
        self.requests = []
        for _, token_ids in self.prompts:
            max_tokens = max_tokens_for(
                requested,
                len(token_ids),
                ctx.max_model_len,
                default=DEFAULT_MAX_TOKENS,
                param="prompt",
            )
            params = sampling_params(
                ctx.sampling_defaults,
                body,
                max_tokens=max_tokens,
                num_logprobs=logprobs,
                vocab_size=ctx.vocab_size,
                num_prompt_logprobs=prompt_logprobs,
            )
            self.requests.append(
                GenerationRequest(
                    token_ids,
                    params,
                    n=self.n,
                    stop=stop,
                    include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
                    skip_special_tokens=get_bool(body, "skip_special_tokens", True),
                    num_top_logprobs=logprobs,
                    num_prompt_logprobs=prompt_logprobs,
                )
            )
        ctx.check_logprob_entries(
            self.n,
            max(
                r.params.max_tokens
                + (len(r.prompt_token_ids) if prompt_logprobs is not None else 0)
                for r in self.requests
            ),
            logprobs,
            param="logprobs",
            prompts=len(self.requests),
        )
        self.generations: list[Generation] = []

    def start(self, ctx: ServerContext) -> None:
        """Admit (429 when full) and start every prompt's generation (on the event loop;
        ``__init__`` may run in a worker thread)."""
        ctx.check_capacity(self.n * len(self.requests))
        try:
            for request in self.requests:
                self.generations.append(ctx.start(request, "cmpl"))
        except BaseException:
            for generation in self.generations:
                generation.abort()
            raise

    def usage(self) -> Usage:
        total = Usage()
        for generation in self.generations:
            total.prompt_tokens += generation.usage.prompt_tokens
            if not self.score_only:  # the one token computed to score a prompt is dropped
                total.completion_tokens += generation.usage.completion_tokens
            total.cached_tokens += generation.usage.cached_tokens
        return total

    def abort(self) -> None:
        for generation in self.generations:
            generation.abort()


async def merged_deltas(
    generations: list[Generation],
) -> AsyncIterator[tuple[int, list[ChoiceDelta]]]:
    """(prompt index, deltas) from every generation, as they arrive."""
    if len(generations) == 1:
        async for batch in generations[0].deltas():
            yield 0, batch
        return
    queue: asyncio.Queue[tuple[int, list[ChoiceDelta] | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for batch in generation.deltas():
                await queue.put((index, batch))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))
            return
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def stream_completion(request: CompletionRequest, body: dict[str, Any]) -> AsyncIterator[str]:
    options = get_dict(body, "stream_options") or {}
    include_usage = bool(options.get("include_usage"))
    head = dumps(
        {
            "id": random_id("cmpl-", 32),
            "object": "text_completion",
            "created": int(time.time()),
            "model": request.model,
        }
    )[:-1]
    tail = ',"usage":null}\n\n' if include_usage else "}\n\n"
    offsets = [
        len(request.prompts[i // request.n][0]) if request.echo else 0
        for i in range(len(request.prompts) * request.n)
    ]
    echoed = [False] * len(offsets)
    first = [True] * len(offsets)
    try:
        async for prompt_index, batch in merged_deltas(request.generations):
            for delta in batch:
                index = prompt_index * request.n + delta.index
                text = delta.text
                generated = [] if request.score_only else delta.logprobs or []
                if request.score_only:
                    text = ""
                if request.echo and not echoed[index]:
                    echoed[index] = True
                    text = request.prompts[prompt_index][0] + text
                    if delta.prompt_logprobs is not None:  # the prompt's entries lead
                        generated = [*delta.prompt_logprobs, *generated]
                        offsets[index] = 0
                entry: dict[str, Any] = {
                    "index": index,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": delta.finish_reason,
                }
                if request.return_token_ids:
                    if first[index]:
                        entry["prompt_token_ids"] = request.prompts[prompt_index][1]
                    entry["token_ids"] = delta.token_ids
                first[index] = False
                if delta.finish_reason == "abort":
                    entry["finish_reason"] = "stop"
                if delta.stop_string is not None:
                    entry["stop_reason"] = delta.stop_string
                if request.num_logprobs is not None and generated:
                    entry["logprobs"] = legacy_logprobs(generated, offsets[index])
                    offsets[index] += sum(len(e.token) for e in generated)
                yield f'data: {head},"choices":[{dumps(entry)}]{tail}'
    except Exception as exc:  # noqa: BLE001 - the runner failed: report it in-stream
        yield data_event(openai_stream_error(exc))
        return
    if include_usage:
        yield f'data: {head},"choices":[],"usage":{dumps(usage_body(request.usage()))}}}\n\n'
    yield DONE


async def complete(request: CompletionRequest) -> dict[str, Any]:
    size = len(request.prompts) * request.n
    texts = [""] * size
    finish: list[str | None] = [None] * size
    stops: list[str | None] = [None] * size
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(size)]
    prompt_logprobs: list[list[TokenLogprob]] = [[] for _ in range(size)]
    token_ids: list[list[int]] = [[] for _ in range(size)]
    async for prompt_index, batch in merged_deltas(request.generations):
        for delta in batch:
            index = prompt_index * request.n + delta.index
            texts[index] += delta.text
            if request.return_token_ids:
                token_ids[index].extend(delta.token_ids)
            finish[index] = delta.finish_reason
            stops[index] = delta.stop_string
            if delta.logprobs and not request.score_only:
                logprobs[index].extend(delta.logprobs)
            if delta.prompt_logprobs is not None:
                prompt_logprobs[index] = delta.prompt_logprobs

    # Logprobs are built here, in pure Python (~1 s for 300k entries with their top lists): the
    # loop yields after each choice's, so other clients are served meanwhile.
    choices = []
    for index in range(size):
        if index and request.num_logprobs is not None:
            await asyncio.sleep(0)
        prompt_text = request.prompts[index // request.n][0]
        generated = "" if request.score_only else texts[index]
        entry: dict[str, Any] = {
            "index": index,
            "text": (prompt_text if request.echo else "") + generated,
            "logprobs": None,
            "finish_reason": "stop" if finish[index] in (None, "abort") else finish[index],
        }
        if request.score_only:
            entry["finish_reason"] = "length"
        elif stops[index] is not None:
            entry["stop_reason"] = stops[index]
        if request.num_logprobs is not None:
            # echo: the prompt's entries first (text offsets from 0), else the completion's
            # offsets start after the echoed prompt text
            offset = 0 if prompt_logprobs[index] or not request.echo else len(prompt_text)
            entry["logprobs"] = legacy_logprobs(prompt_logprobs[index] + logprobs[index], offset)
        if request.return_token_ids:
            entry["prompt_token_ids"] = request.prompts[index // request.n][1]
            entry["token_ids"] = [] if request.score_only else token_ids[index]
        choices.append(entry)
    return {
        "id": random_id("cmpl-", 32),
        "object": "text_completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": choices,
        "usage": usage_body(request.usage()),
    }
