"""``POST /tokenize`` and ``POST /detokenize``: vLLM's token endpoints, with its field names.

- ``/tokenize``: ``prompt`` (a string; ``add_special_tokens`` default true) or chat
  ``messages`` (rendered through the chat template as ``/v1/chat/completions`` renders them,
  with ``tools``, ``add_generation_prompt`` default true, ``continue_final_message``,
  ``chat_template_kwargs``; the template writes any special tokens) -> ``{"count",
  "max_model_len", "tokens", "token_strs"}``
  (``token_strs``: each token's text with ``return_token_strs``, else null).
- ``/detokenize``: ``tokens`` (ids below the vocabulary size) -> ``{"prompt": text}``.

``model``, when given, must be a served name. Nothing is counted against the context (a prompt
longer than it is counted too), and nothing reaches the engine.
"""

from __future__ import annotations

from typing import Any

from resin.server.chat_prompt import build_chat_prompt, normalize_chat_messages, normalize_tools
from resin.server.context import ServerContext
from resin.server.errors import APIError
from resin.server.openai.chat import chat_template_kwargs, request_chat_template
from resin.server.request_fields import get_bool, get_int_list, get_str


def tokenize(ctx: ServerContext, body: dict[str, Any]) -> dict[str, Any]:
    if body.get("model") is not None:
        ctx.check_model(body.get("model"))
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise APIError(400, "send 'prompt' or 'messages', not both", param="messages")
        prompt = build_chat_prompt(
            ctx,
            normalize_chat_messages(body.get("messages")),
            normalize_tools(body.get("tools")),
            chat_template_kwargs(body),
            request_chat_template(ctx, body),
            check_length=False,
            continue_final_message=get_bool(body, "continue_final_message", False),
            add_generation_prompt=get_bool(body, "add_generation_prompt", True),
        )
        token_ids = prompt.token_ids
    else:
        text = get_str(body, "prompt")
        if text is None:
            raise APIError(400, "'prompt' (a string) or 'messages' is required", param="prompt")
        token_ids = ctx.encode(text, add_special_tokens=get_bool(body, "add_special_tokens", True))
    strs = None
    if get_bool(body, "return_token_strs", False):
        strs = [ctx.tokenizer.decode([t]) for t in token_ids]
    return {
        "count": len(token_ids),
        "max_model_len": ctx.max_model_len,
        "tokens": list(token_ids),
        "token_strs": strs,
    }


def detokenize(ctx: ServerContext, body: dict[str, Any]) -> dict[str, Any]:
    if body.get("model") is not None:
        ctx.check_model(body.get("model"))
    if not isinstance(body.get("tokens"), list):
        raise APIError(400, "'tokens' must be an array of token ids", param="tokens")
    token_ids = get_int_list(body, "tokens")
    vocab_size = ctx.tokenizer.vocab_size
    bad = [t for t in token_ids if t < 0 or t >= vocab_size]
    if bad:
        raise APIError(
            400,
            f"'tokens' has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
            param="tokens",
        )
    return {"prompt": ctx.tokenizer.decode(token_ids)}
