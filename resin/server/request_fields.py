"""Typed access to a JSON request body: each getter checks one field and names it in a 400.

Request bodies stay plain dicts: unknown fields are ignored (clients send many — conformance
rule 0.2), and a field of the wrong type or out of range raises :class:`APIError` 400 whose
``param`` is the field's name. ``null`` means "not given" everywhere, as the SDKs send it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from resin.server.errors import APIError

_MISSING = object()


def _bad(name: str, expected: str, value: Any) -> APIError:
    return APIError(
        400, f"'{name}' must be {expected}, got {type(value).__name__} {value!r:.80}", param=name
    )


def _check_range(name: str, value: float, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and value < minimum:
        raise APIError(400, f"'{name}' must be at least {minimum}, got {value}", param=name)
    if maximum is not None and value > maximum:
        raise APIError(400, f"'{name}' must be at most {maximum}, got {value}", param=name)


def get_bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, "a boolean", value)
    return value


def get_int(
    body: Mapping[str, Any],
    name: str,
    default: int | None = None,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _bad(name, "an integer", value)
    _check_range(name, value, minimum, maximum)
    return value


def get_float(
    body: Mapping[str, Any],
    name: str,
    default: float | None = None,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, "a number", value)
    _check_range(name, value, minimum, maximum)
    return float(value)


def get_str(
    body: Mapping[str, Any], name: str, default: str | None = None, *, required: bool = False
) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise APIError(400, f"'{name}' is required", param=name)
        return default
    if not isinstance(value, str):
        raise _bad(name, "a string", value)
    return value


def get_list(body: Mapping[str, Any], name: str, *, required: bool = False) -> list[Any] | None:
    value = body.get(name)
    if value is None:
        if required:
            raise APIError(400, f"'{name}' is required", param=name)
        return None
    if not isinstance(value, list):
        raise _bad(name, "an array", value)
    return value


def get_dict(body: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad(name, "an object", value)
    return value


MAX_STOP_STRING_CHARS = 256
"""The longest stop string taken. Matching holds back the text's tail while it may still
become one, and checking that tail costs up to its length squared a token, so a request of
many-kilobyte stop strings (each a prefix of what the model repeats) stalled every client for
seconds a step (hostile-client fuzzing; OpenAI itself takes at most four stop strings)."""


def get_stop(body: Mapping[str, Any], name: str) -> list[str]:
    """``stop`` / ``stop_sequences``: a string or a list of strings, each at most
    :data:`MAX_STOP_STRING_CHARS` characters."""
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
        raise _bad(name, "a string or an array of strings", value)
    longest = max((len(s) for s in value), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise APIError(
            400,
            f"'{name}' strings must be at most {MAX_STOP_STRING_CHARS} characters, "
            f"got one of {longest}",
            param=name,
        )
    return [s for s in value if s]


def get_int_list(body: Mapping[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        return value
    raise _bad(name, "an array of non-negative integers", value)
