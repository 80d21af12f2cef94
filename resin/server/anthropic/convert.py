"""Anthropic Messages request → OpenAI-style chat messages, tools, tool_choice and template switches.

This module owns the request side of ``/v1/messages`` and ``/v1/messages/count_tokens``
(conformance §3.2); both endpoints call :func:`build_prompt`, so their token counts agree.

- ``system``: a string or text blocks; blocks starting with ``x-anthropic-billing-header``
  (Claude Code's per-request attribution line, which would defeat prefix caching) are dropped.
- ``messages``: roles ``user`` / ``assistant`` / ``system`` (a ``system`` message after the first
  turn is demoted to a ``<system-reminder>`` user turn by ``normalize_chat_messages``). Content is
  a string or blocks: ``text``; ``tool_use`` (assistant) → ``tool_calls`` with JSON arguments;
  ``tool_result`` (user) → ``tool`` messages, in block order (``is_error`` prefixes ``Error: ``);
  ``thinking`` → the assistant's ``reasoning_content``; ``redacted_thinking`` dropped;
  ``image`` / ``document`` → 400 (text-only models); other blocks (``server_tool_use``,
  ``web_search_tool_result``, ``search_result``, ``tool_reference``, ``container_upload``, ...)
  are skipped, or flattened to their text when they carry some.
- ``tools``: custom tools ``{name, description, input_schema}`` → OpenAI function tools
  (``input_schema.type`` defaults to ``object``); schema-less server tools (``web_search_*``,
  ``bash_*``, ``text_editor_*``, ...) are skipped. ``tool_choice`` auto/any/tool/none →
  auto/required/named/none.
- ``thinking`` ``{type: enabled|adaptive}`` → template switches ``enable_thinking`` and
  ``thinking`` True, ``disabled`` → False, under any explicit ``chat_template_kwargs`` (those
  win). ``budget_tokens`` is not enforced; an unknown type leaves the template's default.
  ``display: "omitted"`` is applied to the output (:mod:`.blocks`), not to the prompt.

Unknown fields and block attributes (``cache_control``, ``citations``, ``metadata``, betas) are
ignored. Malformed structure raises :class:`APIError` 400 (rendered in Anthropic's shape).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from resin.server.chat_output import parse_tool_choice
from resin.server.chat_prompt import (
    ChatPrompt,
    build_chat_prompt,
    normalize_chat_messages,
    normalize_tools,
)
from resin.server.context import ServerContext
from resin.server.errors import APIError
from resin.server.request_fields import get_dict

BILLING_HEADER = "x-anthropic-billing-header"
TOOL_ERROR_PREFIX = "Error: "
UNSUPPORTED_MEDIA = ("image", "document")
ROLES = ("user", "assistant", "system")


def _bad(message: str, param: str = "messages") -> APIError:
    return APIError(400, message, param=param)


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, Mapping):
        raise _bad(f"{where}: each content block must be an object")
    kind = block.get("type")
    if not isinstance(kind, str):
        raise _bad(f"{where}: content block 'type' must be a string")
    return kind


def _text_of(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}: a text block needs a string 'text'")
    return text


def _reject_media(kind: str, where: str) -> None:
    if kind in UNSUPPORTED_MEDIA:
        raise _bad(
            f"{where}: this model accepts text only; '{kind}' content blocks are not supported"
        )


def _loose_text(block: Mapping[str, Any]) -> str | None:
    """The text of a block we do not model (``search_result`` and the like), if it has any."""
    if isinstance(block.get("text"), str):
        return block["text"]
    content = block.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [
            part["text"]
            for part in content
            if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        ]
        return "\n".join(texts) if texts else None
    return None


def convert_system(system: Any) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        if system.startswith(BILLING_HEADER):
            system = system.partition("\n")[2]
        return system or None
    if not isinstance(system, list):
        raise _bad("'system' must be a string or an array of text blocks", "system")
    texts = []
    for position, block in enumerate(system):
        where = f"system[{position}]"
        kind = _block_type(block, where)
        if kind != "text":
            raise _bad(f"{where}: system blocks must be text blocks, got {kind!r}", "system")
        text = _text_of(block, where)
        if not text.startswith(BILLING_HEADER):
            texts.append(text)
    return "\n\n".join(texts) if texts else None


def _blocks_text(blocks: list[Any], where: str, *, keep_loose_text: bool = False) -> str:
    """The text blocks of ``blocks`` joined by newlines (media is a 400). Other block kinds are
    dropped, or with ``keep_loose_text`` (search_result, tool_reference, ... inside a
    tool_result) contribute whatever text they carry."""
    texts = []
    for position, block in enumerate(blocks):
        block_where = f"{where}.content[{position}]"
        kind = _block_type(block, block_where)
        _reject_media(kind, block_where)
        if kind == "text":
            texts.append(_text_of(block, block_where))
        elif keep_loose_text:
            loose = _loose_text(block)
            if loose:
                texts.append(loose)
    return "\n".join(texts)


def _tool_result_text(block: Mapping[str, Any], where: str) -> str:
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = _blocks_text(content, where, keep_loose_text=True)
    else:
        raise _bad(f"{where}: tool_result content must be a string or an array of blocks")
    return TOOL_ERROR_PREFIX + text if block.get("is_error") is True else text


def _user_turns(content: list[Any], where: str) -> list[dict[str, Any]]:
    """A user message's blocks → user and tool messages, in block order."""
    turns: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            turns.append({"role": "user", "content": "\n".join(texts)})
            texts.clear()

    for position, block in enumerate(content):
        block_where = f"{where}.content[{position}]"
        kind = _block_type(block, block_where)
        _reject_media(kind, block_where)
        if kind == "text":
            texts.append(_text_of(block, block_where))
        elif kind == "tool_result":
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str):
                raise _bad(f"{block_where}: tool_result needs a string 'tool_use_id'")
            flush()
            turns.append(
                {
                    "role": "tool",
                    "tool_call_id": tool_use_id,
                    "content": _tool_result_text(block, block_where),
                }
            )
        elif kind == "tool_use":
            raise _bad(f"{block_where}: tool_use blocks belong in assistant messages")
        elif kind not in ("thinking", "redacted_thinking"):
            loose = _loose_text(block)
            if loose:
                texts.append(loose)
    flush()
    return turns


def _assistant_turn(content: list[Any], where: str) -> dict[str, Any]:
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for position, block in enumerate(content):
        block_where = f"{where}.content[{position}]"
        kind = _block_type(block, block_where)
        _reject_media(kind, block_where)
        if kind == "text":
            texts.append(_text_of(block, block_where))
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
        elif kind == "tool_use":
            name = block.get("name")
            if not isinstance(name, str) or not name:
                raise _bad(f"{block_where}: tool_use needs a string 'name'")
            arguments = block.get("input")
            if arguments is None:
                arguments = {}
            if not isinstance(arguments, Mapping):
                raise _bad(f"{block_where}: tool_use 'input' must be an object")
            calls.append(
                {
                    "id": block.get("id") if isinstance(block.get("id"), str) else None,
                    "type": "function",
                    "function": {
                        "name": name,
                        "arguments": json.dumps(arguments, ensure_ascii=False),
                    },
                }
            )
        elif kind == "tool_result":
            raise _bad(f"{block_where}: tool_result blocks belong in user messages")
        # redacted_thinking, server_tool_use, web_search_tool_result, ...: not for the template
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    if reasoning:
        turn["reasoning_content"] = "\n".join(reasoning)
    return turn


def convert_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    """Anthropic ``system`` + ``messages`` → OpenAI-style messages (not yet normalised)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array")
    result: list[dict[str, Any]] = []
    system_text = convert_system(system)
    if system_text is not None:
        result.append({"role": "system", "content": system_text})
    for position, message in enumerate(messages):
        where = f"messages[{position}]"
        if not isinstance(message, Mapping):
            raise _bad(f"{where} must be an object")
        role = message.get("role")
        if role not in ROLES:
            raise _bad(f"{where}: 'role' must be one of {', '.join(ROLES)}; got {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            result.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}: 'content' must be a string or an array of content blocks")
        if role == "user":
            result.extend(_user_turns(content, where))
        elif role == "assistant":
            result.append(_assistant_turn(content, where))
        else:
            result.append({"role": "system", "content": _blocks_text(content, where)})
    return result


def convert_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Custom tools → OpenAI function tools; schema-less server tools are skipped."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array", "tools")
    functions = []
    for position, tool in enumerate(tools):
        where = f"tools[{position}]"
        if not isinstance(tool, Mapping):
            raise _bad(f"{where} must be an object", "tools")
        kind = tool.get("type")
        schema = tool.get("input_schema")
        if kind not in (None, "custom") and schema is None:
            continue  # a server tool (web_search_*, bash_*, text_editor_*, ...)
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where}: 'name' must be a non-empty string", "tools")
        if schema is None:
            schema = {}
        if not isinstance(schema, Mapping):
            raise _bad(f"{where}: 'input_schema' must be an object", "tools")
        schema = dict(schema)
        schema.setdefault("type", "object")
        description = tool.get("description")
        functions.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": description if isinstance(description, str) else "",
                    "parameters": schema,
                },
            }
        )
    return normalize_tools(functions)


def convert_tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> Any:
    """Anthropic ``tool_choice`` → the chat layer's ``none``/``auto``/``required``/named."""
    if value is None:
        return parse_tool_choice(None, tools)
    if not isinstance(value, Mapping):
        raise _bad('\'tool_choice\' must be an object such as {"type": "auto"}', "tool_choice")
    kind = value.get("type")
    if kind == "auto":
        return parse_tool_choice("auto", tools)
    if kind == "any":
        if not tools:
            raise _bad('tool_choice {"type": "any"} needs at least one tool', "tool_choice")
        return parse_tool_choice("required", tools)
    if kind == "none":
        return "none"
    if kind == "tool":
        if not isinstance(value.get("name"), str):
            raise _bad("tool_choice of type 'tool' needs a string 'name'", "tool_choice")
        return parse_tool_choice({"type": "function", "name": value["name"]}, tools)
    raise _bad("'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'", "tool_choice")


def template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """``thinking`` → ``enable_thinking`` / ``thinking``, under explicit ``chat_template_kwargs``."""
    kwargs: dict[str, Any] = {}
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, Mapping):
            raise _bad("'thinking' must be an object", "thinking")
        kind = thinking.get("type")
        if kind in ("enabled", "adaptive", "disabled"):
            # Qwen3 / GLM templates read enable_thinking, DeepSeek-V3.1's reads thinking
            kwargs["enable_thinking"] = kwargs["thinking"] = kind != "disabled"
        # an unknown (newer) thinking type leaves the template's default
    kwargs.update(get_dict(body, "chat_template_kwargs") or {})
    return kwargs


def build_prompt(
    ctx: ServerContext, body: Mapping[str, Any], *, check_length: bool = True
) -> tuple[ChatPrompt, Any]:
    """The request's prompt (rendered and tokenized) and its parsed tool_choice;
    ``check_length=False`` (count_tokens) counts a prompt too long for the context too."""
    messages = normalize_chat_messages(convert_messages(body.get("system"), body.get("messages")))
    tools = convert_tools(body.get("tools"))
    tool_choice = convert_tool_choice(body.get("tool_choice"), tools)
    # A final assistant message is a prefill: the answer continues its text.
    last = messages[-1] if messages else {}
    prefill = (
        last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
        and bool(last["content"].strip())
        and not last.get("tool_calls")
    )
    prompt = build_chat_prompt(
        ctx,
        messages,
        tools,
        template_kwargs(body),
        check_length=check_length,
        anthropic=True,
        continue_final_message=prefill,
    )
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping) and choice.get("disable_parallel_tool_use") is True:
        prompt = replace(prompt, max_tool_calls=1)
    return prompt, tool_choice
