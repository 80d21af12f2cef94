"""A model's own tool-call format end to end, for the worked models' serve tests.

:func:`scripted_server` serves a checkpoint with a :class:`ScriptedRunner` that makes the "model"
emit an exact text through the checkpoint's own tokenizer (markers span several tokens, as a real
model's output is split across steps), with the checkpoint's default parsers (no flags).
:func:`check_openai` / :func:`check_anthropic` send one weather question with one tool and check,
streamed and not, that the text before the call is content, the reasoning is reasoning, and the
call is parsed into OpenAI ``tool_calls`` / Anthropic ``thinking`` + ``text`` + ``tool_use`` (the
Anthropic stream carries the input as ``input_json`` deltas).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import openai

from resin.runners.scripted import ScriptedRunner
from resin.server.context import ServerOptions
from resin.server.serve import build_context
from resin.tokenizer import Tokenizer
from tests.server_harness import LiveServer

TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
MESSAGES = [{"role": "user", "content": "Weather in Oslo for two days?"}]
ARGUMENTS = {"city": "Oslo", "days": 2}
REASONING, CONTENT = "Oslo, two days.", "Checking."


@contextmanager
def scripted_server(checkpoint: Path, text: str, model: str) -> Iterator[LiveServer]:
    tokenizer = Tokenizer.from_pretrained(checkpoint)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 8, "markers should span several tokens"
    ctx = build_context(
        checkpoint,
        runner=ScriptedRunner(ids, tokenizer.eos_token_id),
        options=ServerOptions(served_model_names=[model]),
        max_num_seqs=2,
        max_model_len=4096,  # a tools prompt is 1,000+ tokens with the tiny tokenizers
    )
    with LiveServer(ctx) as live:
        yield live


def check_openai(live: LiveServer, model: str, markers: tuple[str, ...]) -> None:
    client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
    tools: Any = [{"type": "function", "function": TOOL}]
    kwargs: Any = dict(model=model, messages=MESSAGES, tools=tools, max_tokens=300, temperature=0)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content or "").strip() == CONTENT
    assert (choice.message.model_extra or {}).get("reasoning", "").strip() == REASONING
    (call,) = choice.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGUMENTS)
    content, arguments, names, finish = "", "", [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.function and tc.function.name:
                    names.append(tc.function.name)
                if tc.function and tc.function.arguments:
                    arguments += tc.function.arguments
            finish = c.finish_reason or finish
    assert content.strip() == CONTENT and not any(m in content for m in markers)
    assert names == ["get_weather"] and json.loads(arguments) == ARGUMENTS
    assert finish == "tool_calls"


def check_anthropic(live: LiveServer, model: str) -> None:
    client = anthropic.Anthropic(base_url=live.base_url, api_key="x", max_retries=0)
    tools: Any = [
        {
            "name": TOOL["name"],
            "description": TOOL["description"],
            "input_schema": TOOL["parameters"],
        }
    ]
    kwargs: Any = dict(model=model, max_tokens=300, messages=MESSAGES, tools=tools)
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, use = message.content
    assert (thinking.thinking.strip(), text.text.strip()) == (REASONING, CONTENT)  # type: ignore[union-attr]
    assert (use.name, use.input) == ("get_weather", ARGUMENTS)  # type: ignore[union-attr]
    with client.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in events, "the tool input streams as input_json_delta"
    assert final.stop_reason == "tool_use"
    assert (final.content[2].type, getattr(final.content[2], "input", None)) == (
        "tool_use",
        ARGUMENTS,
    )
