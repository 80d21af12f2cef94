"""``POST /v1/responses`` request → one chat generation: input items, tools, tool choice, sampling.

The Responses API is served statelessly (conformance §2.1): the client sends the whole history
every turn, as Codex does, and ``previous_response_id`` / ``conversation`` are rejected with 400,
as are ``background: true`` (nothing could fetch the result later) and ``prompt`` (a stored
prompt template: nothing is stored).
This module owns the translation of a request body into what the shared chat plumbing takes:

- ``instructions`` → the first system message; ``input`` (a string = one user message, or a list
  of items) → OpenAI-style chat messages, then :func:`normalize_chat_messages` (``developer`` →
  ``system``; a system/developer item after user turns becomes a ``<system-reminder>`` in a user
  turn, since Qwen-family templates reject a late system message):

  - ``message`` items (roles user/assistant/system/developer; ``input_text``/``output_text``
    parts; ``input_image``/``input_file`` → 400, the model is text-only; other part types are
    skipped);
  - ``function_call`` → assistant ``tool_calls`` (consecutive calls, and calls right after an
    assistant message, merge into one assistant message); ``function_call_output`` → ``tool``;
  - ``custom_tool_call`` / ``custom_tool_call_output`` → a call of a function whose single
    parameter ``input`` holds the raw text, and its ``tool`` result;
  - ``reasoning`` → ``reasoning_content`` of the next assistant message (dropped if none follows);
  - every other item type (``local_shell_call``, ``web_search_call``, ``item_reference``,
    ``compaction``, ``mcp_*`` ...) is skipped, never a 400.

- ``tools`` are flat: ``function`` → a chat function tool; ``custom`` → a function with one
  ``input: string`` parameter; ``namespace`` → its function/custom tools named ``<ns>__<name>``
  for the model; hosted and unknown tool types (``web_search``, ``local_shell``,
  ``tool_search`` ...) are skipped. :class:`ToolTarget` maps each name the model sees back to
  what the client gets (``custom_tool_call`` with raw ``input``; ``name`` + ``namespace``).
- ``tool_choice``: ``none``/``auto``/``required``, ``{"type": "function"|"custom", "name"}``;
  ``allowed_tools`` with mode ``required`` forces a call of one of its tools (mode ``auto``
  means ``auto``); hosted-tool choices mean ``auto``. ``parallel_tool_calls: false`` keeps the
  first call only.
- ``reasoning.effort``: ``"none"`` renders with ``enable_thinking=False``; every effort is also
  passed to the template as ``reasoning_effort``. ``chat_template_kwargs`` (vLLM's extension)
  is honoured too.
- ``text.format`` ``json_schema`` / ``json_object`` is enforced (a grammar, see
  :mod:`resin.server.structured`) when no tool may be called instead, and echoed; ``tool_choice``
  required / named forces one call. ``include``, ``store``, ``prompt_cache_key``, ``parallel_tool_calls``,
  ``metadata``, ``service_tier``, ``truncation``, ``user``, ``background: false`` ... are accepted
  and ignored (``store`` is always reported ``false``: nothing is stored).
- Sampling: ``max_output_tokens`` (absent → the room left in the context), ``temperature``,
  ``top_p``, ``top_logprobs`` (logprobs are also returned when ``include`` asks for
  ``message.output_text.logprobs``), plus the vLLM extensions :func:`sampling_params` reads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from resin.server.chat_output import (
    allowed_tools_choice,
    parse_tool_choice,
    skip_special_tokens,
)
from resin.server.chat_prompt import (
    ChatPrompt,
    build_chat_prompt,
    flatten_content,
    normalize_chat_messages,
    normalize_tools,
)
from resin.server.context import ServerContext
from resin.server.errors import APIError
from resin.server.generation import GenerationRequest
from resin.server.request_fields import get_bool, get_dict, get_int, get_list, get_str
from resin.server.sampling_request import (
    MAX_TOP_LOGPROBS,
    max_tokens_for,
    sampling_params,
)
from resin.server.structured import parse_format, request_grammar, tool_param_paths

CUSTOM_TOOL_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"


@dataclass(frozen=True)
class ToolTarget:
    """What a tool the model calls is to the client: a ``function`` or ``custom`` tool, its
    own name, and the namespace it came from."""

    kind: str
    name: str
    namespace: str | None = None


@dataclass
class ResponsesRequest:
    model: str
    body: dict[str, Any]
    stream: bool
    prompt: ChatPrompt
    tool_choice: str | dict[str, Any]  # as ChatChoice takes it (internal function names)
    targets: dict[str, ToolTarget]  # the name the model sees → what the client gets
    generation: GenerationRequest
    max_output_tokens: int | None  # as requested; None: bounded by the context only


def internal_name(name: str, namespace: str | None) -> str:
    return f"{namespace}__{name}" if namespace else name


def prepare_response(ctx: ServerContext, body: dict[str, Any]) -> ResponsesRequest:
    """Validate a Responses request and build its prompt and :class:`GenerationRequest`."""
    if body.get("previous_response_id") is not None:
        raise APIError(
            400,
            "previous_response_id is not supported (the server is stateless; send the full input)",
            param="previous_response_id",
        )
    if body.get("conversation") is not None:
        raise APIError(
            400,
            "conversation is not supported (the server is stateless; send the full input)",
            param="conversation",
        )
    if get_bool(body, "background", False):
        raise APIError(
            400,
            "background is not supported (the server is stateless: there is "
            "nowhere to fetch the response from later); send the request without "
            "it",
            param="background",
        )
    if body.get("prompt") is not None:
        raise APIError(
            400,
            "prompt (a stored prompt template) is not supported (the server "
            "stores no prompts); send 'instructions' and 'input' instead",
            param="prompt",
        )
    model = ctx.check_model(body.get("model"))
    instructions = get_str(body, "instructions")
    messages = input_messages(instructions, body.get("input"))
    tools, targets = convert_tools(body.get("tools"))
    tool_choice = convert_tool_choice(body.get("tool_choice"), tools, targets)
    prompt = build_chat_prompt(
        ctx, normalize_chat_messages(messages), tools, template_kwargs(body), param="input"
    )
    if not get_bool(body, "parallel_tool_calls", True):
        prompt = replace(prompt, max_tool_calls=1)
    requested = get_int(body, "max_output_tokens", minimum=1)
    max_tokens = max_tokens_for(requested, len(prompt.token_ids), ctx.max_model_len, param="input")
    num_logprobs = get_int(body, "top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    include = get_list(body, "include") or []
    if num_logprobs is None and LOGPROBS_INCLUDE in include:
        num_logprobs = 0
    ctx.check_logprob_entries(1, max_tokens, num_logprobs)
    params = sampling_params(
        ctx.sampling_defaults,
        body,
        max_tokens=max_tokens,
        num_logprobs=num_logprobs,
        vocab_size=ctx.vocab_size,
    )
    text = get_dict(body, "text") or {}
    output_format = parse_format(text.get("format"), "text.format", nested=False)
    paths = tool_param_paths(tools, body.get("tools"), _responses_tool_path)
    grammar = request_grammar(ctx, tools, tool_choice, paths, output_format, prompt)
    generation = GenerationRequest(
        prompt.token_ids,
        params,
        n=1,
        skip_special_tokens=skip_special_tokens(ctx, prompt, tool_choice),
        num_top_logprobs=num_logprobs,
        grammar=grammar,
    )
    return ResponsesRequest(
        model,
        body,
        get_bool(body, "stream", False),
        prompt,
        tool_choice,
        targets,
        generation,
        requested,
    )


def _responses_tool_path(position: int, tool: Mapping[str, Any]) -> tuple[str, str] | None:
    name = tool.get("name")
    if not isinstance(name, str) or tool.get("type") not in ("function", "custom"):
        return None
    suffix = ".parameters" if tool.get("type") == "function" else ""
    return name, f"tools[{position}]{suffix}"


def template_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    reasoning = get_dict(body, "reasoning") or {}
    effort = reasoning.get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise APIError(400, "'reasoning.effort' must be a string", param="reasoning.effort")
        kwargs["reasoning_effort"] = effort
        if effort == "none":
            kwargs["enable_thinking"] = False
    kwargs.update(get_dict(body, "chat_template_kwargs") or {})
    return kwargs


# -- input items → chat messages -------------------------------------------------------------


def input_messages(instructions: str | None, value: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if value is None:
        raise APIError(400, "'input' is required", param="input")
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        converter = _InputConverter(messages)
        for position, item in enumerate(value):
            converter.add(position, item)
    else:
        raise APIError(
            400,
            f"'input' must be a string or an array of input items, got {type(value).__name__}",
            param="input",
        )
    if not messages:
        raise APIError(
            400, "'input' has no messages (and there are no instructions)", param="input"
        )
    return messages


def content_text(content: Any, where: str) -> str:
    """A message's or a tool output's content (a string or a list of parts) as one string;
    part types a text model cannot read are skipped."""
    return flatten_content(content, where, param="input", skip_unknown=True)


def _required_str(item: Mapping[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{where}: '{name}' must be a non-empty string", param="input")
    return value


def _optional_str(item: Mapping[str, Any], name: str, where: str) -> str | None:
    value = item.get(name)
    if value is not None and not isinstance(value, str):
        raise APIError(400, f"{where}: '{name}' must be a string", param="input")
    return value or None


class _InputConverter:
    """Appends the chat messages of input items, one item at a time."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = messages
        self.pending_reasoning: list[str] = []

    def add(self, position: int, item: Any) -> None:
        where = f"input[{position}]"
        if not isinstance(item, Mapping):
            raise APIError(400, f"{where} must be an object", param="input")
        kind = item.get("type") or ("message" if "role" in item else None)
        if not isinstance(kind, str):
            raise APIError(
                400, f"{where} needs a 'type' (or a 'role' for a message)", param="input"
            )
        if kind == "message":
            self._message(item, where)
        elif kind in ("function_call", "custom_tool_call"):
            self._call(item, where, kind)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            text = (
                output
                if isinstance(output, (str, list)) or output is None
                else json.dumps(output, ensure_ascii=False)
            )
            self.messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _required_str(item, "call_id", where),
                    "content": content_text(text, where),
                }
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = content_text(parts, where) if isinstance(parts, list) else ""
            if text:
                self.pending_reasoning.append(text)
        # other item types (local_shell_call, web_search_call, item_reference, compaction,
        # mcp_* ...) have no chat equivalent: skipped, never a 400 (conformance §2.1)

    def _message(self, item: Mapping[str, Any], where: str) -> None:
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise APIError(
                400,
                f"{where}: unknown role {role!r} (user, assistant, system or developer)",
                param="input",
            )
        message: dict[str, Any] = {
            "role": role,
            "content": content_text(item.get("content"), where),
        }
        if role == "assistant":
            self._take_reasoning(message)
        elif self.pending_reasoning:
            self.pending_reasoning.clear()  # no assistant turn follows it: dropped
        self.messages.append(message)

    def _call(self, item: Mapping[str, Any], where: str, kind: str) -> None:
        name = _required_str(item, "name", where)
        namespace = _optional_str(item, "namespace", where)
        call_id = item.get("call_id") or item.get("id")
        if not isinstance(call_id, str):
            raise APIError(400, f"{where}: 'call_id' must be a non-empty string", param="input")
        if kind == "custom_tool_call":
            raw = item.get("input", "")
            if not isinstance(raw, str):
                raise APIError(400, f"{where}: 'input' must be a string", param="input")
            arguments = json.dumps({"input": raw}, ensure_ascii=False)
        else:
            arguments = item.get("arguments", "{}")
            if isinstance(arguments, Mapping):
                arguments = json.dumps(arguments, ensure_ascii=False)
            elif not isinstance(arguments, str):
                raise APIError(400, f"{where}: 'arguments' must be a JSON string", param="input")
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": internal_name(name, namespace), "arguments": arguments},
        }
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            self._take_reasoning(last)
        else:
            message: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call]}
            self._take_reasoning(message)
            self.messages.append(message)

    def _take_reasoning(self, message: dict[str, Any]) -> None:
        if self.pending_reasoning:
            texts = [message["reasoning_content"]] if message.get("reasoning_content") else []
            message["reasoning_content"] = "\n\n".join(texts + self.pending_reasoning)
            self.pending_reasoning.clear()


# -- tools ------------------------------------------------------------------------------------


def convert_tools(value: Any) -> tuple[list[dict[str, Any]] | None, dict[str, ToolTarget]]:
    """Responses tools → (chat function tools, or None; the reverse name map)."""
    if value is None:
        return None, {}
    if not isinstance(value, list):
        raise APIError(400, "'tools' must be an array", param="tools")
    chat_tools: list[dict[str, Any]] = []
    targets: dict[str, ToolTarget] = {}

    def add(tool: Mapping[str, Any], where: str, namespace: str | None) -> None:
        kind = tool.get("type")
        spec = tool
        if kind == "function" and "name" not in tool and isinstance(tool.get("function"), Mapping):
            spec = tool["function"]  # the nested Chat Completions shape, tolerated
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"{where}.name must be a non-empty string", param="tools")
        description = spec.get("description") or ""
        if kind == "custom":
            parameters: Any = CUSTOM_TOOL_PARAMETERS
        else:
            parameters = spec.get("parameters") or {"type": "object", "properties": {}}
            if not isinstance(parameters, Mapping):
                raise APIError(400, f"{where}.parameters must be an object", param="tools")
        full = internal_name(name, namespace)
        targets[full] = ToolTarget(str(kind), name, namespace)
        chat_tools.append(
            {
                "type": "function",
                "function": {"name": full, "description": description, "parameters": parameters},
            }
        )

    for position, tool in enumerate(value):
        where = f"tools[{position}]"
        if not isinstance(tool, Mapping):
            raise APIError(400, f"{where} must be an object", param="tools")
        kind = tool.get("type")
        if kind in ("function", "custom"):
            add(tool, where, None)
        elif kind == "namespace":
            namespace = tool.get("name")
            members = tool.get("tools") or []
            if not isinstance(namespace, str) or not namespace or not isinstance(members, list):
                raise APIError(
                    400,
                    f"{where}: a namespace tool needs a 'name' and a 'tools' array",
                    param="tools",
                )
            for index, member in enumerate(members):
                if isinstance(member, Mapping) and member.get("type") in ("function", "custom"):
                    add(member, f"{where}.tools[{index}]", namespace)
        # web_search, local_shell, tool_search, file_search, mcp and unknown types: skipped
    return normalize_tools(chat_tools), targets


def convert_tool_choice(
    value: Any, tools: list[dict[str, Any]] | None, targets: Mapping[str, ToolTarget]
) -> str | dict[str, Any]:
    if value is None or isinstance(value, str):
        return parse_tool_choice(value, tools)
    if isinstance(value, Mapping):
        kind = value.get("type")
        if kind in ("function", "custom"):
            name = value.get("name")
            namespace = value.get("namespace")
            if not isinstance(name, str) or not (namespace is None or isinstance(namespace, str)):
                raise APIError(
                    400, f"tool_choice of type {kind!r} needs a 'name'", param="tool_choice"
                )
            full = internal_name(name, namespace)
            target = targets.get(full)
            if target is None or target.kind != kind:
                raise APIError(
                    400,
                    f"tool_choice names {kind} tool {name!r}, which is not in 'tools'",
                    param="tool_choice",
                )
            return {"type": "function", "name": full}
        if kind == "allowed_tools":
            listed = value.get("tools")
            internal = [
                {**entry, "name": internal_name(entry["name"], entry.get("namespace"))}
                if isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                else entry
                for entry in (listed if isinstance(listed, list) else [])
            ]
            return allowed_tools_choice(value.get("mode"), internal, tools)
        if isinstance(kind, str):  # a hosted tool the model is not offered
            return "auto" if tools else "none"
    raise APIError(
        400,
        "'tool_choice' must be 'none', 'auto', 'required' or "
        "{'type': 'function'|'custom', 'name': ...}",
        param="tool_choice",
    )
