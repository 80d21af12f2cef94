"""Sampling fields shared by every endpoint → :class:`resin.SamplingParams`, and the token budget.

``sampling_params(ctx, body, ...)`` reads ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``seed``, the three penalties, ``logit_bias``, ``ignore_eos``, ``min_tokens``,
``stop_token_ids`` and the logprob count from a request body, on top of the checkpoint's
``generation_config.json`` defaults (vLLM's rule), and checks their ranges (400 naming the
field). Token ids are checked against the vocabulary here as well as in the engine, because a
stream's headers go out before the engine sees the request.

``max_tokens_for(...)`` turns a requested completion length into the engine's ``max_tokens``:
absent → the room left in the context (or an endpoint default such as completions' 16, capped
by that room); too large → ``context_length_exceeded`` (OpenAI) or clamped to the room
(Anthropic: Claude Code asks for 32k regardless of the model's context).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from resin._core import SamplingParams
from resin.server.errors import APIError, context_length_exceeded
from resin.server.request_fields import get_bool, get_float, get_int, get_int_list

MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**63 - 1  # the engine's seeds are non-negative int64 (negative ones are mapped)
MAX_TOP_K = 2**31 - 1  # any k past the vocabulary means "off"


def max_tokens_for(
    requested: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    *,
    default: int | None = None,
    clamp: bool = False,
    anthropic: bool = False,
    param: str = "messages",
) -> int:
    if num_prompt_tokens >= max_model_len:
        raise context_length_exceeded(
            max_model_len, num_prompt_tokens, requested, anthropic=anthropic, param=param
        )
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        if clamp:
            return room
        raise context_length_exceeded(
            max_model_len, num_prompt_tokens, requested, anthropic=anthropic, param=param
        )
    return requested


def check_token_ids(param: str, token_ids: Iterable[int], vocab_size: int | None) -> None:
    """400 naming ``param`` for a token id outside ``[0, vocab_size)`` (no check without one)."""
    if vocab_size is None:
        return
    for token in token_ids:
        if not 0 <= token < vocab_size:
            raise APIError(
                400, f"'{param}': token {token} is not below vocab_size {vocab_size}", param=param
            )


def get_logit_bias(body: Mapping[str, Any]) -> dict[int, float]:
    """OpenAI's ``logit_bias``: an object of token id (a string of digits, as JSON keys are, or
    an int) -> bias, a number in [-100, 100]; absent or null -> {}. 400 naming the field
    otherwise."""
    raw = body.get("logit_bias")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise APIError(
            400, "'logit_bias' must be an object of token id -> bias", param="logit_bias"
        )
    bias: dict[int, float] = {}
    for key, value in raw.items():
        text = key if isinstance(key, str) else None
        if isinstance(key, int) and not isinstance(key, bool):
            text = str(key)
        if text is None or not text.isdigit() or not text.isascii() or len(text) > 10:
            raise APIError(
                400,
                f"'logit_bias' keys must be token ids (non-negative integers), got {key!r}",
                param="logit_bias",
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise APIError(
                400, f"'logit_bias[{text}]' must be a number, got {value!r}", param="logit_bias"
            )
        if not -100.0 <= value <= 100.0:  # NaN fails too (and a huge int, unconverted)
            raise APIError(
                400,
                f"'logit_bias[{text}]' must be in [-100, 100], got {value!r}",
                param="logit_bias",
            )
        token = int(text)
        if token in bias:  # "5" and "05"
            raise APIError(400, f"'logit_bias' gives token {token} twice", param="logit_bias")
        bias[token] = float(value)
    return bias


def sampling_params(
    defaults: Mapping[str, Any],
    body: Mapping[str, Any],
    *,
    max_tokens: int,
    num_logprobs: int | None,
    temperature_max: float = 2.0,
    vocab_size: int | None = None,
    num_prompt_logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams from the request's fields over the checkpoint ``defaults``; token ids
    (``logit_bias``, ``stop_token_ids``) checked below ``vocab_size`` when it is given."""
    settings: dict[str, Any] = dict(defaults)
    settings["max_tokens"] = max_tokens
    logit_bias = get_logit_bias(body)
    if logit_bias:
        check_token_ids("logit_bias", logit_bias, vocab_size)
        settings["logit_bias"] = logit_bias
    temperature = get_float(body, "temperature", minimum=0.0, maximum=temperature_max)
    if temperature is not None:
        settings["temperature"] = temperature
    top_p = get_float(body, "top_p", minimum=0.0, maximum=1.0)
    if top_p is not None:
        if top_p == 0.0:  # some clients send 0 for "greedy"; the sampler needs > 0
            settings["temperature"] = 0.0
        else:
            settings["top_p"] = top_p
    top_k = get_int(body, "top_k", minimum=-1, maximum=MAX_TOP_K)
    if top_k is not None:
        settings["top_k"] = max(top_k, 0)  # -1 (vLLM) and 0 both mean "off"
    min_p = get_float(body, "min_p", minimum=0.0, maximum=1.0)
    if min_p is not None:
        settings["min_p"] = min_p
    seed = get_int(body, "seed", minimum=-(2**63), maximum=MAX_SEED)
    if seed is not None:
        settings["seed"] = seed % 2**63  # any int64, as OpenAI and vLLM take (-1 -> 2^63 - 1)
    for name in ("presence_penalty", "frequency_penalty"):
        value = get_float(body, name, minimum=-2.0, maximum=2.0)
        if value is not None:
            settings[name] = value
    repetition_penalty = get_float(body, "repetition_penalty", minimum=0.0)
    if repetition_penalty is not None:
        if repetition_penalty == 0.0:
            raise APIError(
                400, "'repetition_penalty' must be greater than 0", param="repetition_penalty"
            )
        settings["repetition_penalty"] = repetition_penalty
    settings["ignore_eos"] = get_bool(body, "ignore_eos", False)
    min_tokens = get_int(body, "min_tokens", minimum=0)
    if min_tokens is not None:
        settings["min_tokens"] = min(min_tokens, max_tokens)
    stop_token_ids = get_int_list(body, "stop_token_ids")
    if stop_token_ids:
        check_token_ids("stop_token_ids", stop_token_ids, vocab_size)
        settings["stop_token_ids"] = stop_token_ids
    if num_logprobs is not None:
        settings["logprobs"] = num_logprobs
    if num_prompt_logprobs is not None:
        settings["prompt_logprobs"] = num_prompt_logprobs
    try:
        return SamplingParams(**settings)
    except (ValueError, TypeError, OverflowError) as exc:
        raise APIError(400, f"invalid sampling parameters: {exc}") from exc
