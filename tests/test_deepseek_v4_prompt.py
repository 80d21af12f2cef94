"""DeepSeek-V4 prompts (``resin.chat_encodings.deepseek_v4``): golden prompts, the checkpoint
rule, and the server rendering a deepseek_v4 checkpoint's chat requests with the encoder.

Where the golden strings come from: DeepSeek's encoder documentation (``encoding/README.md``
next to ``encoding_dsv4.py`` in the DeepSeek-V4 release; SGLang and vLLM vendor the same
encoder). Its formats, quoted:

- basic chat: ``<｜begin▁of▁sentence｜>{system_prompt}<｜User｜>{user_message}<｜Assistant｜></think>
  {response}<｜end▁of▁sentence｜>`` — in chat mode ``</think>`` closes the thinking block right
  after ``<｜Assistant｜>``;
- thinking mode: ``<｜User｜>{message}<｜Assistant｜><think>{reasoning}</think>{response}
  <｜end▁of▁sentence｜>``; without tools "reasoning content from assistant turns before the last
  user message is stripped"; with tools ``drop_thinking`` is disabled and every turn keeps it;
- tools: the "## Tools" block (the text of :data:`TOOLS_V4` below) appended to the system
  prompt after a blank line, the schemas one JSON object per line; calls as
  ``\\n\\n<｜DSML｜tool_calls>`` blocks, ``string="true"`` for strings and ``string="false"`` + JSON
  otherwise; tool results merged into the following user turn as
  ``<tool_result>{content}</tool_result>``.

The strings were also checked (outside this repository) against DeepSeek's reference
``encode_messages`` on its four shipped test inputs and 3,000 random conversations.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from resin.chat_encodings.deepseek_v4 import (
    encode_messages,
    encoding_for_config,
    render,
    thinking_requested,
)
from resin.chat_template import ChatTemplate
from resin.runners.scripted import ScriptedRunner
from resin.server.context import ServerContext, ServerOptions
from resin.server.serve import build_context
from tests.server_harness import LiveServer

TINY = Path(__file__).parent.parent / "resin" / "models" / "deepseek_v4_flash" / "tiny"
MODEL = "dsv4"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"

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
WEATHER_JSON = (
    '{"name": "get_weather", "description": "Weather for a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, '
    '"required": ["city"]}}'
)
TOOLS_V4 = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke "
    'tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    "</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other '
    "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete "
    "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    f"{WEATHER_JSON}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
    {"role": "user", "content": "How are you?"},
]
TOOL_CONVERSATION = [
    {"role": "system", "content": "You check the weather."},
    {"role": "user", "content": "Weather in Oslo and Rome?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Two calls.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
            },
        ],
    },
    # results out of call order: the encoder puts them in the order of the calls
    {"role": "tool", "tool_call_id": "call_2", "content": "Rome: 25°C"},
    {"role": "tool", "tool_call_id": "call_1", "content": "Oslo: 3°C"},
]
OSLO_CALL = (
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>"
)
ROME_CALL = (
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>"
)


# -- golden prompts ------------------------------------------------------------------------


def test_plain_chat_in_chat_mode():
    """README "Basic Chat": BOS, no system text, ``<｜Assistant｜></think>`` in chat mode."""
    prompt = encode_messages([{"role": "user", "content": "What is 2+2?"}], thinking=False)
    assert prompt == f"{BOS}{USER}What is 2+2?{ASSISTANT}</think>"


def test_plain_chat_in_thinking_mode():
    """README "Quick Start" example, verbatim."""
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert (
        encode_messages(messages, thinking=True)
        == "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?"
        "<｜Assistant｜><think>"
    )


def test_system_and_multi_turn_drop_earlier_reasoning():
    """Thinking mode without tools: the earlier assistant turn loses its reasoning (and its
    ``</think>``); its user turn ends ``<｜Assistant｜></think>``; the latest opens ``<think>``."""
    assert encode_messages(CONVERSATION, thinking=True) == (
        f"{BOS}Be brief.{USER}Hi{ASSISTANT}</think>Hello!{EOS}{USER}How are you?{ASSISTANT}<think>"
    )
    # chat mode: the same, with </think> for the latest turn too
    assert encode_messages(CONVERSATION, thinking=False) == (
        f"{BOS}Be brief.{USER}Hi{ASSISTANT}</think>Hello!{EOS}{USER}How are you?{ASSISTANT}</think>"
    )
    # two user messages in a row are one user turn, joined by a blank line
    doubled = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert encode_messages(doubled, thinking=False) == f"{BOS}{USER}a\n\nb{ASSISTANT}</think>"


def test_tools_tool_call_and_tool_results():
    """Tools after the system prompt; with tools every turn keeps its reasoning; the calls as
    one DSML block; both results in one user turn, in call order."""
    prompt = encode_messages(TOOL_CONVERSATION, tools=[WEATHER], thinking=True)
    assert prompt == (
        f"{BOS}You check the weather.\n\n{TOOLS_V4}"
        f"{USER}Weather in Oslo and Rome?{ASSISTANT}<think>"
        f"Two calls.</think>\n\n<｜DSML｜tool_calls>\n{OSLO_CALL}\n{ROME_CALL}\n</｜DSML｜tool_calls>"
        f"{EOS}{USER}<tool_result>Oslo: 3°C</tool_result>\n\n<tool_result>Rome: 25°C"
        f"</tool_result>{ASSISTANT}<think>"
    )
    # chat mode: no reasoning anywhere, every turn opens with </think>
    chat = encode_messages(TOOL_CONVERSATION, tools=[WEATHER], thinking=False)
    assert chat == (
        f"{BOS}You check the weather.\n\n{TOOLS_V4}"
        f"{USER}Weather in Oslo and Rome?{ASSISTANT}</think>"
        f"\n\n<｜DSML｜tool_calls>\n{OSLO_CALL}\n{ROME_CALL}\n</｜DSML｜tool_calls>"
        f"{EOS}{USER}<tool_result>Oslo: 3°C</tool_result>\n\n<tool_result>Rome: 25°C"
        f"</tool_result>{ASSISTANT}</think>"
    )


def test_tools_without_a_system_message_and_typed_arguments():
    """No system message: the tools section alone follows BOS (an empty system message);
    non-string arguments are JSON with string="false"; arguments that are no JSON object are
    one ``arguments`` string."""
    messages = [
        {"role": "user", "content": "Go"},
        {
            "role": "assistant",
            "content": "Calling.",
            "tool_calls": [
                {
                    "function": {
                        "name": "f",
                        "arguments": {"n": 1.5, "ok": True, "none": None, "xs": [1, "北"]},
                    }
                },
                {"function": {"name": "g", "arguments": "not json"}},
            ],
        },
    ]
    prompt = encode_messages(messages, tools=[WEATHER], thinking=False)
    assert prompt.startswith(f"{BOS}\n\n{TOOLS_V4}{USER}Go{ASSISTANT}</think>Calling.\n\n")
    assert prompt.endswith(
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="n" string="false">1.5</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="ok" string="false">true</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="none" string="false">null</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="xs" string="false">[1, "北"]</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="g">\n'
        '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        f"</｜DSML｜tool_calls>{EOS}"
    )


def test_thinking_switch_from_template_kwargs():
    """On by default (vLLM's rule); ``thinking`` / ``enable_thinking`` switch it; Anthropic's
    ``thinking`` block sets both."""
    assert thinking_requested({})
    assert thinking_requested({"thinking": True})
    assert thinking_requested({"enable_thinking": True, "thinking": False})
    assert not thinking_requested({"enable_thinking": False})
    assert not thinking_requested({"thinking": False, "enable_thinking": False})
    hi = [{"role": "user", "content": "hi"}]
    assert render("deepseek_v4", hi).endswith(f"{ASSISTANT}<think>")
    assert render("deepseek_v4", hi, enable_thinking=False).endswith(f"{ASSISTANT}</think>")
    assert render("deepseek_v4", hi, thinking=False).endswith(f"{ASSISTANT}</think>")


def test_reasoning_effort_max_and_drop_thinking_kwarg():
    hi = [{"role": "user", "content": "hi"}]
    maximal = render("deepseek_v4", hi, reasoning_effort="max")
    assert maximal.startswith(
        f"{BOS}Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very "
        "thorough"
    )
    assert maximal.endswith("is left unchecked.\n\n<｜User｜>hi<｜Assistant｜><think>")
    # high / other values / chat mode: nothing added
    assert render("deepseek_v4", hi, reasoning_effort="high") == f"{BOS}{USER}hi{ASSISTANT}<think>"
    assert render("deepseek_v4", hi, reasoning_effort="max", thinking=False) == (
        f"{BOS}{USER}hi{ASSISTANT}</think>"
    )
    # drop_thinking=False keeps the earlier reasoning, as with tools
    kept = render("deepseek_v4", CONVERSATION, drop_thinking=False)
    assert kept == (
        f"{BOS}Be brief.{USER}Hi{ASSISTANT}<think>A greeting.</think>Hello!{EOS}"
        f"{USER}How are you?{ASSISTANT}<think>"
    )


def test_v41_spelling():
    """V4.1 (SGLang's / vLLM's ``encoding_dsv41``): spaced DSML tags, ``<｜System｜>``, and a
    "Reasoning Effort: N" line in thinking mode (default high = 50)."""
    messages = [
        {"role": "system", "content": "Sys."},
        {"role": "user", "content": "Go"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": "x"}}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "done"},
    ]
    chat = encode_messages(messages, encoding="deepseek_v41", thinking=False)
    assert chat == (
        f"{BOS}<｜System｜>Sys.{USER}Go{ASSISTANT}</think>\n\n<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="true">x</｜DSML｜ parameter>'
        f"\n</｜DSML｜ invoke>\n</｜DSML｜ calls>{EOS}{USER}<tool_result>done</tool_result>"
        f"{ASSISTANT}</think>"
    )
    effort = "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"  # noqa: E501
    hi = [{"role": "user", "content": "hi"}]
    assert encode_messages(hi, encoding="deepseek_v41") == (
        f"{BOS}<｜System｜>{effort.format(50)}{USER}hi{ASSISTANT}<think>"
    )
    assert encode_messages(hi, encoding="deepseek_v41", reasoning_effort="max") == (
        f"{BOS}<｜System｜>{effort.format(100)}{USER}hi{ASSISTANT}<think>"
    )
    assert encode_messages(
        [{"role": "system", "content": "S"}, *hi], encoding="deepseek_v41", reasoning_effort=7
    ) == (f"{BOS}<｜System｜>{effort.format(7)}S{USER}hi{ASSISTANT}<think>")
    tools = encode_messages(hi, encoding="deepseek_v41", tools=[WEATHER], thinking=False)
    assert 'writing a "<｜DSML｜ calls>" block' in tools
    assert '<｜DSML｜ parameter name="$PARAMETER_NAME"' in tools
    # a later system message is its own turn and opens the assistant's
    late = [*hi, {"role": "assistant", "content": "ok"}, {"role": "system", "content": "Now X."}]
    assert encode_messages(late, encoding="deepseek_v41", thinking=False).endswith(
        f"ok{EOS}<｜System｜>Now X.{ASSISTANT}</think>"
    )


def test_continue_final_message_leaves_the_assistant_open():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    template = ChatTemplate(None, encoding="deepseek_v4")
    assert template.render(messages, continue_final_message=True, enable_thinking=False) == (
        f"{BOS}{USER}hi{ASSISTANT}</think>Hel"
    )


# -- which checkpoints ---------------------------------------------------------------------


def test_encoding_for_config():
    assert encoding_for_config({"model_type": "deepseek_v4"}) == "deepseek_v4"
    assert encoding_for_config({"architectures": ["DeepseekV4ForCausalLM"]}) == "deepseek_v4"
    assert encoding_for_config({"model_type": "deepseek_v41"}) == "deepseek_v41"
    assert (
        encoding_for_config(
            {"model_type": "deepseek_v41", "architectures": ["DeepseekV4ForCausalLM"]}
        )
        == "deepseek_v41"
    )
    assert encoding_for_config({"architectures": ["DeepseekV41ForCausalLM"]}) == "deepseek_v41"
    for other in ("deepseek_v3", "deepseek_v32", "qwen3"):
        assert encoding_for_config({"model_type": other}) is None


def test_checkpoint_template_uses_the_encoder_unless_a_template_is_given():
    """The tiny checkpoint ships a ChatML template (its tokenizer is a test fixture's); being
    deepseek_v4, it renders with DeepSeek's encoder; an explicit template still wins."""
    template = ChatTemplate.from_pretrained(TINY)
    assert template.encoding == "deepseek_v4"
    hi = [{"role": "user", "content": "hi"}]
    assert template.render(hi, add_generation_prompt=True) == f"{BOS}{USER}hi{ASSISTANT}<think>"
    chatml = template.select()
    assert template.render(hi, add_generation_prompt=True, chat_template=chatml) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


# -- through the server --------------------------------------------------------------------


class RecordingRunner(ScriptedRunner):
    """A ScriptedRunner that keeps every request's input tokens (prompt, then the fed-back
    output), in order, keyed by request id."""

    def __init__(self, script: list[int], eos_token_id: int) -> None:
        super().__init__(script, eos_token_id)
        self.inputs: dict[str, list[int]] = {}

    def forward(self, plan: Any) -> Any:
        ids, indptr, computed = plan.input_ids, plan.query_indptr, plan.num_computed_tokens
        for row, request_id in enumerate(plan.request_ids):
            seen = self.inputs.setdefault(request_id, [])
            assert int(computed[row]) == len(seen), "no prefix-cache hits with caching off"
            seen.extend(int(t) for t in ids[indptr[row] : indptr[row + 1]])
        return super().forward(plan)

    def prompts(self) -> list[list[int]]:
        return list(self.inputs.values())


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerContext, RecordingRunner, LiveServer]]:
    template = ChatTemplate.from_pretrained(TINY)
    assert template.encoding == "deepseek_v4"
    runner = RecordingRunner([], 1)
    ctx = build_context(
        TINY,
        runner=runner,
        max_num_seqs=2,
        max_model_len=4096,
        enable_prefix_caching=False,
        options=ServerOptions(served_model_names=[MODEL]),
    )
    with LiveServer(ctx) as live:
        yield ctx, runner, live


def _script(ctx: ServerContext, runner: RecordingRunner, text: str) -> None:
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    runner.script = ScriptedRunner(ids, ctx.tokenizer.eos_token_id).script
    runner.inputs.clear()


def _expected_ids(ctx: ServerContext, text: str) -> list[int]:
    return ctx.tokenizer.encode(text, add_special_tokens=False)


def test_openai_chat_renders_with_the_encoder(served):
    ctx, runner, live = served
    assert (ctx.options.tool_parser, ctx.options.reasoning_parser) == ("deepseek_v4",) * 2
    _script(
        ctx,
        runner,
        'Paris next.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls>",
    )
    client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
    messages: list[Any] = json.loads(json.dumps(TOOL_CONVERSATION))
    messages[2]["tool_calls"][1]["function"]["arguments"] = '{"city": "Rome"}'
    response = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=200,
        extra_body={"return_token_ids": True},
    )
    expected = encode_messages(TOOL_CONVERSATION, tools=[WEATHER], thinking=True)
    [prompt] = runner.prompts()
    ids = _expected_ids(ctx, expected)
    assert prompt[: len(ids)] == ids
    assert (response.model_extra or {})["prompt_token_ids"] == ids
    assert response.usage is not None and response.usage.prompt_tokens == len(ids)
    # the prompt opened <think>: the output starts as reasoning, then a DSML call
    message = response.choices[0].message
    assert (message.model_extra or {}).get("reasoning") == "Paris next."
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}

    # thinking off through chat_template_kwargs: the prompt ends </think>, output is content
    _script(ctx, runner, "Fine.")
    response = client.chat.completions.create(
        model=MODEL,
        messages=CONVERSATION,  # type: ignore[arg-type]
        max_tokens=20,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    [prompt] = runner.prompts()
    ids = _expected_ids(ctx, encode_messages(CONVERSATION, thinking=False))
    assert prompt[: len(ids)] == ids
    assert response.choices[0].message.content == "Fine."


def test_anthropic_messages_and_count_tokens_render_with_the_encoder(served):
    ctx, runner, live = served
    _script(ctx, runner, "Hello.")
    client = anthropic.Anthropic(base_url=live.base_url, api_key="x", max_retries=0, timeout=60)
    try:
        messages: Any = [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How are you?"},
        ]
        response = client.messages.create(
            model=MODEL,
            system="Be brief.",
            messages=messages,
            max_tokens=20,
            thinking={"type": "disabled"},
        )
        expected = encode_messages(CONVERSATION, thinking=False)
        [prompt] = runner.prompts()
        ids = _expected_ids(ctx, expected)
        assert prompt[: len(ids)] == ids
        assert response.usage.input_tokens == len(ids)
        assert [b.text for b in response.content if b.type == "text"] == ["Hello."]
        counted = client.messages.count_tokens(
            model=MODEL, system="Be brief.", messages=messages, thinking={"type": "disabled"}
        )
        assert counted.input_tokens == len(ids)
        # without a thinking block: thinking mode, the prompt ends <think>
        thinking = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
        ids = _expected_ids(ctx, encode_messages(CONVERSATION, thinking=True))
        assert thinking.input_tokens == len(ids)
    finally:
        client.close()


def test_llm_chat_agrees_with_the_server(served):
    """``LLM.chat`` renders through the same ``ChatTemplate``: the same prompt ids."""
    from resin.llm import LLM

    ctx, runner, _ = served
    llm = LLM(TINY, runner=ScriptedRunner([], 1), max_num_seqs=1, max_model_len=4096)
    [output] = llm.chat(CONVERSATION, enable_thinking=False)
    assert output.prompt == encode_messages(CONVERSATION, thinking=False)
    assert output.prompt_token_ids == _expected_ids(ctx, output.prompt)
