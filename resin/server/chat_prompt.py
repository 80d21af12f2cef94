"""OpenAI-style chat messages + tools → the prompt's token ids, through the model's chat template.

Every chat API ends here: ``/v1/chat/completions`` directly, ``/v1/responses`` and
``/v1/messages`` after converting their input to OpenAI-style messages. ``build_chat_prompt``:

1. normalises messages (conformance §8.2): ``developer`` → ``system``; leading system messages
   merge into one; a later ``system`` message (Codex after compaction, Claude Code's mid-turn
   reminders) becomes ``<system-reminder>…</system-reminder>`` text in a user turn, because
   Qwen-family templates reject a system message that is not first; text parts flatten to a
   string; assistant ``tool_calls[].function.arguments`` are parsed from JSON strings to
   objects (templates ``tojson`` them); ``reasoning`` → ``reasoning_content``;
2. renders with ``add_generation_prompt=True`` plus ``tools`` and ``chat_template_kwargs``
   (a DeepSeek-V4 checkpoint renders with DeepSeek's encoder instead of a template, inside
   ``ChatTemplate.render``: :mod:`resin.chat_encodings.deepseek_v4`);
3. tokenizes without adding special tokens (the template has them), as ``LLM.chat`` does — so
   the server and ``resin.LLM.chat`` build identical prompts — unless the rendered text is too
   long to fit the context whatever it tokenizes to (refused untokenized). Handlers call this
   in a worker thread for large requests (:meth:`ServerContext.prepare`).

It also reports whether the prompt ends inside an open ``<think>`` block (a template that
pre-fills ``<think>\\n``: output starts as reasoning) or right after ``</think>`` (thinking
switched off, e.g. ``enable_thinking=False``: no reasoning parsing at all).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from resin.chat_template import ChatTemplateError
from resin.server.context import ServerContext
from resin.server.errors import APIError
from resin.server.request_body import check_json_value

SYSTEM_REMINDER = "<system-reminder>\n{}\n</system-reminder>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass
class ChatPrompt:
    text: str
    token_ids: list[int]
    tools: list[dict[str, Any]] | None  # OpenAI function tools, as rendered
    reasoning_started: bool  # the prompt ends inside an open <think> block
    reasoning_closed: bool = False  # the prompt ends with "</think>": thinking switched off
    # 1 when the request allows no parallel calls (OpenAI parallel_tool_calls false, Anthropic
    # disable_parallel_tool_use): calls after the first are dropped, as vLLM does; else None
    max_tool_calls: int | None = None


TEXT_PARTS = ("text", "input_text", "output_text", "summary_text", "reasoning_text")
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "file", "input_file")


def flatten_content(
    content: Any, where: str, *, param: str = "messages", skip_unknown: bool = False
) -> str:
    """A message's content (a string, or a list of parts) as one string: text parts joined by
    newlines; media parts are a 400 (the runners are text-only); other part types are a 400,
    or skipped with ``skip_unknown`` (the Responses API, whose clients send many)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(
            400, f"{where}: content must be a string or an array of content parts", param=param
        )
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, Mapping):
            raise APIError(400, f"{where}: each content part must be an object", param=param)
        kind = part.get("type")
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in TEXT_PARTS:
            raise APIError(400, f"{where}: a '{kind}' part's 'text' must be a string", param=param)
        elif kind in MEDIA_PARTS:
            raise APIError(
                400,
                f"{where}: this model accepts text only; '{kind}' content is not supported",
                param=param,
            )
        elif not skip_unknown:
            raise APIError(400, f"{where}: unsupported content part type {kind!r}", param=param)
    return "\n".join(texts)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise APIError(400, f"{where}: tool_calls must be an array", param="messages")
    result = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise APIError(400, f"{where}: each tool call needs function.name", param="messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass  # keep the raw string; templates print strings as they are
            # A "\\ud83d" escape inside the string decodes to a lone surrogate, which the body's
            # own check could not see and the tokenizer cannot take: a 400, not a 500.
            check_json_value(arguments)
        result.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return result


def normalize_chat_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty array", param="messages")
    system_texts: list[str] = []
    turns: list[dict[str, Any]] = []
    for position, message in enumerate(messages):
        where = f"messages[{position}]"
        if not isinstance(message, Mapping):
            raise APIError(400, f"{where} must be an object", param="messages")
        role = message.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool", "function"):
            raise APIError(400, f"{where}: unknown role {role!r}", param="messages")
        if role == "system":
            text = flatten_content(message.get("content"), where)
            if not turns:
                system_texts.append(text)
            else:
                _append_user_text(turns, SYSTEM_REMINDER.format(text))
            continue
        turn: dict[str, Any] = {
            "role": "tool" if role == "function" else role,
            "content": flatten_content(message.get("content"), where),
        }
        if role == "assistant":
            if message.get("tool_calls"):
                turn["tool_calls"] = _tool_calls(message["tool_calls"], where)
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                turn["reasoning_content"] = reasoning
        if turn["role"] == "tool":
            turn["tool_call_id"] = message.get("tool_call_id")
            if message.get("name"):
                turn["name"] = message["name"]
        turns.append(turn)
    if system_texts:
        turns.insert(0, {"role": "system", "content": "\n\n".join(system_texts)})
    return turns


def _append_user_text(turns: list[dict[str, Any]], text: str) -> None:
    if turns and turns[-1]["role"] == "user":
        turns[-1]["content"] = f"{turns[-1]['content']}\n\n{text}" if turns[-1]["content"] else text
    else:
        turns.append({"role": "user", "content": text})


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI chat tools; unknown tool types are skipped, not rejected (conformance §2.4)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be an array", param="tools")
    result = []
    for position, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise APIError(400, f"tools[{position}] must be an object", param="tools")
        if tool.get("type", "function") != "function":
            continue
        function = tool.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise APIError(400, f"tools[{position}].function.name is required", param="tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise APIError(
                400,
                f"tools[{position}].function.parameters must be a JSON Schema object",
                param=f"tools[{position}].function.parameters",
            )
        entry = {
            "name": function["name"],
            "description": function.get("description", ""),
            "parameters": parameters or {"type": "object", "properties": {}},
        }
        result.append({"type": "function", "function": entry})
    return result or None


def build_chat_prompt(
    ctx: ServerContext,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    chat_template: str | None = None,
    *,
    check_length: bool = True,
    anthropic: bool = False,
    param: str = "messages",
    continue_final_message: bool = False,
    add_generation_prompt: bool = True,
) -> ChatPrompt:
    """Render normalised messages (see :func:`normalize_chat_messages`) and tokenize. With
    ``check_length`` (every generating endpoint; not ``count_tokens``), a rendered text that
    cannot fit the context is refused before it is tokenized (:meth:`ServerContext.
    check_prompt_text`). ``continue_final_message``: the last message is an assistant's to
    continue (an Anthropic prefill, vLLM's chat field of that name): rendered open, as
    transformers' ``apply_chat_template`` does, with no new generation prompt."""
    kwargs = dict(chat_template_kwargs or {})
    for reserved in ("messages", "tools", "add_generation_prompt", "continue_final_message"):
        kwargs.pop(reserved, None)
    if ctx.model_type == "gpt_oss":
        messages = gpt_oss_replayable(messages)
    try:
        text = ctx.chat_template.render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            chat_template=chat_template or ctx.options.chat_template,
            **kwargs,
        )
    except (ChatTemplateError, ValueError, TypeError) as exc:
        raise APIError(
            400,
            f"chat template error: {exc}",
            param="messages",
            headers={"x-should-retry": "false"},
        ) from exc
    if check_length:
        ctx.check_prompt_text(text, anthropic=anthropic, param=param)
    token_ids = ctx.encode(text, add_special_tokens=False)
    if not token_ids:
        raise APIError(400, "the rendered prompt is empty", param="messages")
    tail = text.rstrip()
    # A continued assistant message is content unless it left a <think> block open.
    inside_think = tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)
    return ChatPrompt(
        text,
        token_ids,
        tools,
        reasoning_started=tail.endswith(THINK_OPEN) or (continue_final_message and inside_think),
        reasoning_closed=tail.endswith(THINK_CLOSE)
        or (continue_final_message and not inside_think),
    )


def gpt_oss_replayable(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as gpt-oss's chat template takes them back. It refuses an assistant
    message with tool calls that has both content and reasoning ("Cannot pass both content and
    thinking"), and renders either one as the call's analysis message; a client replays
    exactly that from our own output (a preamble is content, the analysis reasoning). So the
    content joins the reasoning there, after it, as the template would have rendered it."""
    replayable = []
    for message in messages:
        reasoning = message.get("reasoning_content")
        if message.get("role") == "assistant" and message.get("tool_calls"):
            if reasoning and message.get("content"):
                message = {
                    **message,
                    "reasoning_content": f"{reasoning}\n\n{message['content']}",
                    "content": "",
                }
        replayable.append(message)
    return replayable


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> set[str]:
    return {t["function"]["name"] for t in tools or ()}
