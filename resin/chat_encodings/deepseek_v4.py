"""The DeepSeek-V4 prompt encoder: chat messages + tools → the prompt text DeepSeek-V4 and V4.1
were trained on.

DeepSeek-V4 ships no Jinja chat template; its prompts are built by DeepSeek's Python encoder
(``encoding_dsv4.py``'s ``encode_messages``, V4.1: ``encoding/encoding.py``; SGLang vendors
both as ``encoding_dsv4.py`` / ``encoding_dsv41.py``, vLLM as ``deepseek_v4_encoding.py`` /
``deepseek_v41_encoding.py``). This module owns that format, written from those encoders'
behaviour; :func:`render` is what :class:`resin.chat_template.ChatTemplate` calls instead of a
template. The prompt, message by message (the bars are U+FF5C, ``▁`` is U+2581)::

    <｜begin▁of▁sentence｜>{system}[\\n\\n{tools section}]
    <｜User｜>{user}<｜Assistant｜><think>        (thinking mode, latest user turn)
    <｜User｜>{user}<｜Assistant｜></think>       (chat mode, or an earlier turn)
    {reasoning}</think>{content}[\\n\\n{DSML tool calls}]<｜end▁of▁sentence｜>

- **System**: its text, then ``\\n\\n`` + the tools section when the request has tools (the
  tools ride on the first message when it is a system or developer message, else on an empty
  system message put first, as vLLM and SGLang do). V4.1 writes ``<｜System｜>`` before a
  system message and accepts one mid-conversation (it then opens the next assistant turn like
  a user message). A ``developer`` message is a user turn (``<｜User｜>`` + text + tools).
- **Tools section**: :data:`TOOLS_TEMPLATE` — DeepSeek's instruction text verbatim, with each
  tool's ``function`` object as one line of JSON (``ensure_ascii=False``, the request's key
  order).
- **User and tool messages**: a tool result has no role of its own: each run of user / tool
  messages becomes one ``<｜User｜>`` turn whose parts (a user text, or
  ``<tool_result>{content}</tool_result>``) are joined by ``\\n\\n``, tool results in the order
  of the preceding assistant's ``tool_calls`` (by ``tool_call_id``).
- **Assistant**: ``{reasoning}</think>`` in thinking mode, then the content, then its tool
  calls as one DSML block (``\\n\\n<｜DSML｜tool_calls>`` … one ``invoke`` per call, one
  ``parameter`` per argument: ``string="true"`` and the raw text for a string, ``string="false"``
  and JSON for anything else), then ``<｜end▁of▁sentence｜>``. V4.1 spells the tags
  ``<｜DSML｜ calls>`` / ``<｜DSML｜ invoke`` / ``<｜DSML｜ parameter`` (a space after the marker).
- **The generation prompt**: after the last user turn, ``<｜Assistant｜>`` + ``<think>`` in
  thinking mode, ``</think>`` in chat mode — what the ``deepseek_v4`` reasoning parser reads.
- **Earlier reasoning** (thinking mode): dropped from every assistant turn before the last user
  turn — those turns get neither reasoning nor ``</think>``, and their user turns end
  ``<｜Assistant｜></think>`` — unless the request has tools: then every assistant turn keeps
  ``{reasoning}</think>`` and every user turn opens ``<think>`` (DeepSeek keeps an agent's
  chain of thought across tool calls). Chat mode renders no reasoning at all.
- **Reasoning effort** (thinking mode only, at the very start): V4: ``max`` adds DeepSeek's
  "Reasoning Effort: Absolute maximum…" paragraph (:data:`V4_MAX_EFFORT`); ``high`` and any
  other value add nothing. V4.1: always ``Reasoning Effort: N (range 1-100, …)``, N an integer
  1–100 or ``low`` 25 / ``high`` 50 (the default) / ``xhigh`` 75 / ``max`` 100; other values
  count as the default.

Thinking mode is on unless the chat-template kwargs switch it off: ``thinking`` or
``enable_thinking`` (either truthy → thinking; present and all falsy → chat), as vLLM's DeepSeek-V4
tokenizer decides (SGLang defaults to chat). Anthropic's ``thinking`` block sets both.
``reasoning_effort`` and ``drop_thinking`` are read from the same kwargs; others are ignored.

Which spelling: :func:`encoding_for_config` — ``deepseek_v41`` for a ``config.json`` whose
``model_type`` is ``deepseek_v41`` or whose architecture names ``DeepseekV41`` (SGLang's rule:
V4.1 checkpoints may reuse the V4 architecture name, so the model type is checked first),
``deepseek_v4`` for model type ``deepseek_v4`` or a ``DeepseekV4…`` architecture, else ``None``.

Not rendered: DeepSeek's internal ``task`` tokens, ``response_format`` and images (the
runners are text-only). Only the standard library is imported.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from resin.chat_template import REASONING_FIELDS, ChatTemplateError, normalize_messages

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"  # V4.1 only
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
DSML = "｜DSML｜"

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{dsml}{block}>" block like the following:

<{dsml}{block}>
<{dsml}{invoke} name="$TOOL_NAME">
<{dsml}{parameter} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}{parameter}>
...
</{dsml}{invoke}>
<{dsml}{invoke} name="$TOOL_NAME2">
...
</{dsml}{invoke}>
</{dsml}{block}>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_open}), you MUST output your complete reasoning inside {think_open}...{think_close} BEFORE any tool calls or final response.

Otherwise, output directly after {think_close} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501 - DeepSeek's instruction text, one line per paragraph

V4_MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)
V41_EFFORT = (
    "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
V41_EFFORT_LEVELS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}
V41_DEFAULT_EFFORT = "high"


@dataclass(frozen=True)
class Spelling:
    """What differs between DeepSeek-V4 and V4.1 prompts."""

    block: str  # the DSML block's tag name
    invoke: str
    parameter: str
    system_token: bool  # <｜System｜> before system messages; a later one opens a turn
    numeric_effort: bool  # "Reasoning Effort: N" always (V4.1) vs the "max" paragraph (V4)


ENCODINGS = {
    "deepseek_v4": Spelling("tool_calls", "invoke", "parameter", False, False),
    "deepseek_v41": Spelling(" calls", " invoke", " parameter", True, True),
}


def encoding_for_config(config: Mapping[str, Any]) -> str | None:
    """The encoding of a checkpoint's ``config.json``: ``deepseek_v41``, ``deepseek_v4``, or
    ``None`` (not a DeepSeek-V4 checkpoint: use its chat template)."""
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    names = [a for a in architectures if isinstance(a, str)]
    if model_type == "deepseek_v41" or any("DeepseekV41" in a for a in names):
        return "deepseek_v41"
    if model_type == "deepseek_v4" or any(a.startswith("DeepseekV4") for a in names):
        return "deepseek_v4"
    return None


def thinking_requested(kwargs: Mapping[str, Any]) -> bool:
    """Thinking mode from chat-template kwargs: on unless ``thinking`` / ``enable_thinking``
    are given and none of them is truthy."""
    given = [kwargs[k] for k in ("thinking", "enable_thinking") if k in kwargs]
    return not given or any(bool(v) for v in given)


def render(
    encoding: str,
    messages: Sequence[Any],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    continue_final_message: bool | str = False,
    **kwargs: Any,
) -> str:
    """The prompt for ``messages`` in ``encoding`` (a key of :data:`ENCODINGS`), with the
    chat-template kwargs (``thinking`` / ``enable_thinking``, ``reasoning_effort``,
    ``drop_thinking``; others are ignored). ``continue_final_message`` leaves the final
    assistant message open (no end-of-sentence)."""
    kwargs.pop("add_generation_prompt", None)  # the encoder always opens the next turn
    drop_thinking = kwargs.get("drop_thinking", True)
    return encode_messages(
        messages,
        encoding=encoding,
        tools=tools,
        thinking=thinking_requested(kwargs),
        reasoning_effort=kwargs.get("reasoning_effort"),
        drop_thinking=True if drop_thinking is None else bool(drop_thinking),
        continue_final_message=bool(continue_final_message),
    )


def encode_messages(
    messages: Sequence[Any],
    *,
    encoding: str = "deepseek_v4",
    tools: Sequence[Mapping[str, Any]] | None = None,
    thinking: bool = True,
    reasoning_effort: str | int | None = None,
    drop_thinking: bool = True,
    continue_final_message: bool = False,
) -> str:
    """DeepSeek's ``encode_messages`` for OpenAI-style messages (``tool_calls`` arguments as
    objects or JSON strings; ``reasoning_content`` / ``reasoning`` / ``thinking``)."""
    spelling = ENCODINGS.get(encoding)
    if spelling is None:
        raise ChatTemplateError(f"unknown DeepSeek encoding {encoding!r}; known: {list(ENCODINGS)}")
    if isinstance(messages, (str, bytes)) or not messages:
        raise ValueError(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    turns = _attach_tools(_plain(messages), tools)
    if continue_final_message:
        if turns[-1].get("role") != "assistant":
            raise ValueError("continue_final_message needs a final assistant message")
        turns[-1]["open"] = True
    turns = _order_tool_results(_merge_user_turns(turns))
    drop = drop_thinking and not any(t.get("tools") for t in turns)
    if thinking and drop:
        turns = _drop_earlier_reasoning(turns, spelling)
    effort = _effort_prefix(spelling, thinking, reasoning_effort)
    last_user = _last_user_index(turns, spelling)
    prompt = [BOS]
    for index in range(len(turns)):
        prompt.append(_render_turn(turns, index, last_user, spelling, thinking, drop, effort))
    return "".join(prompt)


# -- preprocessing --------------------------------------------------------------------------


def _plain(messages: Sequence[Any]) -> list[dict[str, Any]]:
    turns = []
    for message in normalize_messages(messages):
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        turns.append(message)
    return turns


def _attach_tools(
    turns: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    if not tools:
        return turns
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise TypeError(f"Tools should be JSON-schema dicts, got {type(tool).__name__}")
    if turns[0].get("role") in ("system", "developer"):
        turns[0] = {**turns[0], "tools": list(tools)}  # request tools win over the message's
    else:
        turns.insert(0, {"role": "system", "content": "", "tools": list(tools)})
    return turns


def _merge_user_turns(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of user / tool messages → one user turn with ``parts``."""
    merged: list[dict[str, Any]] = []
    for turn in turns:
        role = turn.get("role")
        if role == "tool":
            part = {"tool_result": turn.get("content"), "id": turn.get("tool_call_id")}
        elif role == "user":
            part = {"text": turn.get("content")}
        else:
            merged.append(turn)
            continue
        if merged and merged[-1].get("role") == "user":
            merged[-1]["parts"].append(part)
        else:
            merged.append({"role": "user", "parts": [part]})
    return merged


def _order_tool_results(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool results in the order of the latest assistant's calls (unknown ids first, stable)."""
    order: dict[Any, int] = {}
    for turn in turns:
        if turn.get("role") == "assistant" and turn.get("tool_calls"):
            order = {}
            for position, call in enumerate(turn["tool_calls"]):
                call_id = call.get("id") if isinstance(call, Mapping) else None
                if call_id:
                    order[call_id] = position
        elif turn.get("role") == "user" and order:
            results = [p for p in turn["parts"] if "tool_result" in p]
            if len(results) > 1:
                ranked = iter(sorted(results, key=lambda p: order.get(p.get("id"), 0)))
                turn["parts"] = [next(ranked) if "tool_result" in p else p for p in turn["parts"]]
    return turns


def _last_user_index(turns: list[dict[str, Any]], spelling: Spelling) -> int:
    for index in range(len(turns) - 1, -1, -1):
        if _opens_turn(turns, index, spelling):
            return index
    return -1


def _opens_turn(turns: list[dict[str, Any]], index: int, spelling: Spelling) -> bool:
    """Whether the message at ``index`` is one the assistant answers (a user turn)."""
    role = turns[index].get("role")
    return role in ("user", "developer") or (
        spelling.system_token and role == "system" and index > 0
    )


def _drop_earlier_reasoning(
    turns: list[dict[str, Any]], spelling: Spelling
) -> list[dict[str, Any]]:
    """Before the last user turn: assistants lose their reasoning, developer messages go."""
    last_user = _last_user_index(turns, spelling)
    kept = []
    for index, turn in enumerate(turns):
        role = turn.get("role")
        if index >= last_user or role in ("user", "system", "tool", "latest_reminder"):
            kept.append(turn)
        elif role == "assistant":
            kept.append({k: v for k, v in turn.items() if k != "reasoning_content"})
    return kept


def _effort_prefix(spelling: Spelling, thinking: bool, effort: Any) -> str:
    if not thinking:
        return ""
    if not spelling.numeric_effort:
        return V4_MAX_EFFORT if effort == "max" else ""
    if not (type(effort) is int and 1 <= effort <= 100):
        effort = V41_EFFORT_LEVELS.get(effort, V41_EFFORT_LEVELS[V41_DEFAULT_EFFORT])
    return V41_EFFORT.format(effort)


# -- rendering ------------------------------------------------------------------------------


def _render_turn(
    turns: list[dict[str, Any]],
    index: int,
    last_user: int,
    spelling: Spelling,
    thinking: bool,
    drop: bool,
    effort: str,
) -> str:
    turn = turns[index]
    role = turn.get("role")
    text = ""
    if index == 0 and effort:
        text += SYSTEM + effort if spelling.system_token else effort
    if role == "system":
        if spelling.system_token and not (index == 0 and effort):
            text += SYSTEM
        text += _text(turn.get("content")) + _tools_section(turn.get("tools"), spelling)
    elif role == "developer":
        content = _text(turn.get("content"))
        if not content:
            raise ChatTemplateError(f"a developer message needs content: {turn!r}")
        text += USER + content + _tools_section(turn.get("tools"), spelling)
    elif role == "user":
        text += USER + "\n\n".join(_user_part(part) for part in turn["parts"])
    elif role == "latest_reminder":
        text += LATEST_REMINDER + _text(turn.get("content"))
    elif role == "assistant":
        if thinking and (not drop or index > last_user):
            text += _text(turn.get("reasoning_content")) + THINK_CLOSE
        text += _text(turn.get("content"))
        if turn.get("tool_calls"):
            text += "\n\n" + _tool_calls(turn["tool_calls"], spelling)
        if not turn.get("open"):
            text += EOS
    else:
        raise ChatTemplateError(f"DeepSeek-V4 prompts have no role {role!r}")
    following = turns[index + 1].get("role") if index + 1 < len(turns) else None
    if following not in (None, "assistant", "latest_reminder"):
        return text
    if _opens_turn(turns, index, spelling):
        opens_thinking = thinking and (not drop or index >= last_user)
        text += ASSISTANT + (THINK_OPEN if opens_thinking else THINK_CLOSE)
    return text


def _text(content: Any) -> str:
    """Message text: a string, or the text parts of a list joined by blank lines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type") == "text":
                texts.append(_text(part.get("text")))
            elif isinstance(part, Mapping):
                texts.append(f"[Unsupported {part.get('type')}]")  # as DeepSeek's encoder
        return "\n\n".join(texts)
    return str(content)


def _user_part(part: Mapping[str, Any]) -> str:
    if "tool_result" in part:
        return f"<tool_result>{_text(part['tool_result'])}</tool_result>"
    return _text(part.get("text"))


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ChatTemplateError(f"cannot write {value!r} as JSON: {exc}") from exc


def _tools_section(tools: Any, spelling: Spelling) -> str:
    if not tools:
        return ""
    functions = [t["function"] if isinstance(t.get("function"), Mapping) else t for t in tools]
    return "\n\n" + TOOLS_TEMPLATE.format(
        dsml=DSML,
        block=spelling.block,
        invoke=spelling.invoke,
        parameter=spelling.parameter,
        think_open=THINK_OPEN,
        think_close=THINK_CLOSE,
        schemas="\n".join(_json(f) for f in functions),
    )


def _tool_calls(calls: Sequence[Any], spelling: Spelling) -> str:
    invokes = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatTemplateError("each assistant tool call needs function.name")
        parameters = "\n".join(
            f'<{DSML}{spelling.parameter} name="{key}" string="{"true" if isinstance(value, str) else "false"}">'  # noqa: E501
            f"{value if isinstance(value, str) else _json(value)}</{DSML}{spelling.parameter}>"
            for key, value in _arguments(function.get("arguments")).items()
        )
        invokes.append(
            f'<{DSML}{spelling.invoke} name="{function["name"]}">\n{parameters}\n'
            f"</{DSML}{spelling.invoke}>"
        )
    block = spelling.block
    return f"<{DSML}{block}>\n" + "\n".join(invokes) + f"\n</{DSML}{block}>"


def _arguments(arguments: Any) -> dict[str, Any]:
    """A call's arguments as an object: an object as is, a JSON string decoded; anything else
    (text that is not a JSON object) becomes ``{"arguments": text}``, as DeepSeek's encoder."""
    if arguments is None:
        return {}
    value = arguments
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError:
            pass
    if isinstance(value, dict):
        return value
    return {"arguments": arguments}
