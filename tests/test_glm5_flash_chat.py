"""GLM-5.3-Flash's chat template on the tiny checkpoint (resin/models/glm5_flash/tiny).

The template is the checkpoint's ``chat_template.jinja`` (``source/chat_template.jinja``; where it
comes from: NOTES.md, "Chat template"), carried in the tiny tokenizer's config with GLM's special
tokens. Resin's rendering (``resin.chat_template``) is byte-identical to transformers'
``apply_chat_template`` for a system + user turn, multi-turn with reasoning, tools, an assistant
tool call, tool results and ``enable_thinking`` on / off; the prompt's token ids agree too. The
serving parsers read what the template implies: the generation prompt ends inside ``<think>``
(pre-filled), so the model's reasoning runs to ``</think>``; a tool call ends reasoning; the
template's own rendering of a past tool call is what the ``glm47`` tool parser parses.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

from resin.chat_template import ChatTemplate  # noqa: E402
from resin.server.parsers.output_parser import OutputParser  # noqa: E402
from resin.tokenizer import Tokenizer  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "resin" / "models" / "glm5_flash" / "tiny"
SOURCE = TINY.parent / "source" / "chat_template.jinja"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}},
}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "system_user": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello!"},
    ],
    "multi_turn_reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning_content": "Add them.", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>Again.</think>6"},
        {"role": "user", "content": "Thanks"},
    ],
    "tool_call_and_result": [
        {"role": "system", "content": "You check the weather."},
        {"role": "user", "content": "Weather in Oslo for two days?"},
        {
            "role": "assistant",
            "reasoning_content": "Oslo, two days.",
            "content": "Checking.",
            "tool_calls": [CALL],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    ],
    "two_results_unordered": [
        {"role": "user", "content": "Oslo and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                CALL,
                {
                    **CALL,
                    "id": "call_2",
                    "function": {**CALL["function"], "arguments": {"city": "Rome"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "snow"},
    ],
    "content_parts": [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Read "}, {"type": "text", "text": "this"}],
        },
    ],
}
KWARGS: list[dict[str, Any]] = [
    {},
    {"enable_thinking": False},
    {"enable_thinking": True},
    {"clear_thinking": True},
    {"reasoning_effort": "low"},
]


@pytest.fixture(scope="module")
def hf() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(TINY))


def test_the_tiny_checkpoint_carries_the_template_and_glm_tokens(hf: Any) -> None:
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    assert config["chat_template"] == SOURCE.read_text()
    tokenizer = Tokenizer.from_pretrained(TINY)
    for token in (
        "[gMASK]",
        "<sop>",
        "<|assistant|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "<arg_key>",
        "<arg_value>",
        "<tool_response>",
        "<|observation|>",
    ):
        (token_id,) = tokenizer.encode(token, add_special_tokens=False)
        assert hf.convert_ids_to_tokens(token_id) == token
    assert tokenizer.encode("hi", add_special_tokens=True) == hf.encode("hi")  # no BOS added
    generation = json.loads((TINY / "generation_config.json").read_text())
    stops = {hf.convert_ids_to_tokens(i) for i in generation["eos_token_id"]}
    assert stops == {"<|endoftext|>", "<|user|>", "<|observation|>"}


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_is_byte_identical_to_transformers(
    hf: Any, conversation: str, with_tools: bool, add_generation_prompt: bool
) -> None:
    ours = ChatTemplate.from_pretrained(TINY)
    tokenizer = Tokenizer.from_pretrained(TINY)
    tools = [WEATHER] if with_tools else None
    for kwargs in KWARGS:
        messages = CONVERSATIONS[conversation]
        theirs = hf.apply_chat_template(
            copy.deepcopy(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **kwargs,
        )
        text = ours.render(
            copy.deepcopy(messages),
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **kwargs,
        )
        assert text == theirs, kwargs
        assert tokenizer.encode(text, add_special_tokens=False) == hf.encode(
            theirs, add_special_tokens=False
        )


def test_the_grid_reaches_the_template_branches(hf: Any) -> None:
    """Not a vacuous grid: what each case exists for is in the rendering."""
    render = ChatTemplate.from_pretrained(TINY).render
    text = render(
        CONVERSATIONS["tool_call_and_result"], tools=[WEATHER], add_generation_prompt=True
    )
    assert text.startswith("[gMASK]<sop><|system|>Reasoning Effort: Max<|system|>\n# Tools")
    assert '"name": "get_weather"' in text
    assert (
        "<|assistant|><think>Oslo, two days.</think>Checking.<tool_call>get_weather"
        "<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
    ) in text
    assert '<|observation|><tool_response>{"temp": 3}</tool_response>' in text
    assert text.endswith("<|assistant|><think>")
    off = render(CONVERSATIONS["system_user"], add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|assistant|><think></think>")
    multi = render(CONVERSATIONS["multi_turn_reasoning"])
    assert "<think>Add them.</think>4" in multi and "<think>Again.</think>6" in multi
    cleared = render(CONVERSATIONS["multi_turn_reasoning"], clear_thinking=True)
    assert "<think></think>4" in cleared and "Add them." not in cleared
    unordered = render(CONVERSATIONS["two_results_unordered"])  # results sorted by call id
    assert unordered.index("snow") < unordered.index("sunny")
    assert "Reasoning Effort: Low" in render(CONVERSATIONS["system_user"], reasoning_effort="low")


def _parse(
    text: str, prompt: str, tools: list[dict[str, Any]] | None
) -> tuple[str, str, list[Any]]:
    parser = OutputParser(
        reasoning_parser="glm45",
        tool_parser="glm47" if tools else None,
        tools=tools,
        reasoning_started=prompt.rstrip().endswith("<think>"),
    )
    events = list(parser.feed(text)) + list(parser.finish())
    reasoning = "".join(
        getattr(e, "text", "") for e in events if type(e).__name__ == "ReasoningDelta"
    )
    content = "".join(getattr(e, "text", "") for e in events if type(e).__name__ == "ContentDelta")
    calls = [e for e in events if type(e).__name__ == "ToolCallStart"]
    return reasoning, content, calls


def test_the_parsers_read_what_the_template_implies() -> None:
    """After ``<|assistant|><think>`` the model writes its reasoning, ``</think>``, then content and
    calls in the template's own format (the assistant turn it renders for a past call)."""
    render = ChatTemplate.from_pretrained(TINY).render
    messages = CONVERSATIONS["tool_call_and_result"][:2]
    prompt = render(messages, tools=[WEATHER], add_generation_prompt=True)
    history = render(CONVERSATIONS["tool_call_and_result"][:3], tools=[WEATHER])
    turn = history[len(render(messages, tools=[WEATHER])) :]
    assert turn.startswith("<|assistant|><think>")
    emitted = turn[len("<|assistant|><think>") :]  # what the model writes after the prompt
    reasoning, content, calls = _parse(emitted, prompt, [WEATHER])
    assert reasoning == "Oslo, two days." and content.strip() == "Checking."
    assert [c.name for c in calls] == ["get_weather"]
    # A call without closing the reasoning ends it (GLM does this).
    unclosed = (
        "Oslo.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>"
    )
    reasoning, content, calls = _parse(unclosed, prompt, [WEATHER])
    assert reasoning == "Oslo." and [c.name for c in calls] == ["get_weather"]
    # Thinking off: the prompt closes the block; the output is content.
    off = render(messages, add_generation_prompt=True, enable_thinking=False)
    assert _parse("Hello.", off, None)[:2] == ("", "Hello.")
