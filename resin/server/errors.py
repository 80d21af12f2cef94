"""HTTP errors in each API's own shape: one exception type, two body formats.

Handlers raise :class:`APIError` (status, message, OpenAI ``type``/``code``/``param``); the app
renders it as the OpenAI body ``{"error": {"message", "type", "param", "code"}}`` everywhere
except under ``/v1/messages``, where it becomes Anthropic's ``{"type": "error", "error":
{"type", "message"}, "request_id"}`` with the matching Anthropic error type.

The helpers build the errors clients grep for: ``context_length_exceeded`` with OpenAI's
"maximum context length" wording (and Anthropic's "prompt is too long" wording), and
``model_not_found``.
"""

from __future__ import annotations

import re
from typing import Any

from resin.server.ids import random_id

ANTHROPIC_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
OPENAI_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error response: ``status`` and the OpenAI-style ``type``/``code``/``param``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,  # noqa: A002
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or OPENAI_ERROR_TYPES.get(status, "invalid_request_error")
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        return {
            "type": "error",
            "error": {
                "type": ANTHROPIC_ERROR_TYPES.get(
                    self.status, "invalid_request_error" if self.status < 500 else "api_error"
                ),
                "message": self.message,
            },
            "request_id": random_id("req_"),
        }


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def rejected(message: str) -> APIError:
    """The 400 for a request the engine refused; its message names the field
    (``SamplingParams.<field>: ...``) when a setting was the reason."""
    field = re.match(r"SamplingParams\.(\w+):", message)
    return APIError(400, message, param=field.group(1) if field else None)


def openai_stream_error(exc: Exception) -> dict[str, Any]:
    """The in-stream error event of an OpenAI stream that failed after its headers went out:
    a request the engine refused is the 400 it would have been; anything else (the runner
    failed) a ``server_error``, code 500."""
    from resin.server.engine_loop import RequestRejected

    if isinstance(exc, RequestRejected):
        return rejected(str(exc)).openai_body()
    return {"error": {"message": str(exc), "type": "server_error", "param": None, "code": 500}}


def context_length_exceeded(
    max_model_len: int,
    num_prompt_tokens: int,
    max_tokens: int | None,
    *,
    anthropic: bool = False,
    param: str = "messages",
) -> APIError:
    """Prompt (plus the requested completion) over the context, worded as clients expect."""
    if anthropic:
        if max_tokens is None or num_prompt_tokens >= max_model_len:
            message = (
                f"prompt is too long: {num_prompt_tokens} tokens > {max_model_len - 1} maximum"
            )
        else:
            message = (
                f"input length and `max_tokens` exceed context limit: {num_prompt_tokens} "
                f"+ {max_tokens} > {max_model_len}, decrease input length or "
                "`max_tokens` and try again"
            )
    elif max_tokens is None:  # the prompt alone fills the context (no completion size asked yet)
        where, verb = ("messages", "have") if param == "messages" else ("prompt", "has")
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{where} {verb} {num_prompt_tokens} tokens, which leaves no room for the "
            f"completion. Please reduce the length of the {where}."
        )
    else:
        requested = num_prompt_tokens + max_tokens
        where = "messages" if param == "messages" else "prompt"
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {requested} tokens ({num_prompt_tokens} in the {where}, "
            f"{max_tokens} in the completion). Please reduce the length of the "
            f"{where} or completion."
        )
    return APIError(
        400,
        message,
        code="context_length_exceeded",
        param=param,
        headers={"x-should-retry": "false"},
    )


def prompt_too_long(
    max_model_len: int, at_least: int, *, anthropic: bool = False, param: str = "messages"
) -> APIError:
    """A prompt known to exceed the context from its length alone (not tokenized, so only a
    lower bound on its token count is known); same code and wording as above."""
    if anthropic:
        message = f"prompt is too long: at least {at_least} tokens > {max_model_len - 1} maximum"
    else:
        where = "messages" if param == "messages" else "prompt"
        verb = "are" if where == "messages" else "is"
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"the {where} {verb} at least {at_least} tokens long (counted from the "
            f"length of the text, which was not tokenized). Please reduce the length "
            f"of the {where}."
        )
    return APIError(
        400,
        message,
        code="context_length_exceeded",
        param=param,
        headers={"x-should-retry": "false"},
    )


def model_not_found(model: str) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist.", code="model_not_found", param="model"
    )
