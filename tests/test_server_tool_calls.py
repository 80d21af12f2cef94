"""Tool calls and reasoning through ``/v1/chat/completions`` for every parser, streamed and not.

A :class:`ScriptedRunner` makes the "model" emit an exact text in each family's format; the
fixture's byte-level BPE splits every marker across several tokens, as real models' outputs
are split across steps. Through the official ``openai`` SDK: the non-streaming message and
the concatenated stream deltas must agree, arguments must be JSON objects, tool-call markers
must never reach ``content``, and ``finish_reason`` must be ``tool_calls``.
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from resin.runners.scripted import ScriptedRunner
from resin.server.context import ServerOptions
from resin.server.serve import build_context
from resin.tokenizer import Tokenizer
from tests.server_harness import LiveServer

FIXTURES = Path(__file__).parent / "fixtures"
MODEL = "scripted"
TOOLS = [
    {
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
]
DS_BEGIN, DS_CALL, DS_SEP, DS_END, DS_ALL_END = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)

# parser name -> (reasoning parser, scripted model output, expected content, reasoning, calls)
CASES = {
    "hermes": (
        "qwen3",
        "<think>\nCheck the weather.\n</think>\n\nLet me look.<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "SF", "days": 2}}\n</tool_call>',
        "Let me look.",
        "Check the weather.",
        [("get_weather", {"city": "SF", "days": 2})],
    ),
    "qwen3_coder": (
        "qwen3",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nSF\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>",
        "",
        "",
        [("get_weather", {"city": "SF", "days": 3}), ("get_weather", {"city": "Paris"})],
    ),
    "deepseek_v3": (
        "deepseek_r1",
        f"Thinking it over.</think>{DS_BEGIN}{DS_CALL}function{DS_SEP}"
        f'get_weather\n```json\n{{"city": "Oslo"}}\n```{DS_END}{DS_ALL_END}',
        "",
        "Thinking it over.",
        [("get_weather", {"city": "Oslo"})],
    ),
    "deepseek_v31": (
        None,
        f'Sure.{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{"city": "Rome", '
        f'"days": 1}}{DS_END}{DS_ALL_END}',
        "Sure.",
        "",
        [("get_weather", {"city": "Rome", "days": 1})],
    ),
    "deepseek_v32": (
        None,
        'Sure.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">北京</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        "</｜DSML｜function_calls>",
        "Sure.",
        "",
        [("get_weather", {"city": "北京", "days": 3})],
    ),
    "deepseek_v4": (
        "deepseek_v4",
        '<think>Two cities.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Rome'
        '</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
        "",
        "Two cities.",
        [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome", "days": 2})],
    ),
    "glm45": (
        "glm45",
        "<think>weather?</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Lima</arg_value>\n<arg_key>days</arg_key>\n<arg_value>5</arg_value>\n"
        "</tool_call>",
        "",
        "weather?",
        [("get_weather", {"city": "Lima", "days": 5})],
    ),
    "llama3_json": (
        None,
        '{"name": "get_weather", "parameters": {"city": "Kyiv"}}; '
        '{"name": "get_weather", "parameters": {"city": "Baku", "days": 4}}',
        "",
        "",
        [("get_weather", {"city": "Kyiv"}), ("get_weather", {"city": "Baku", "days": 4})],
    ),
}


@pytest.fixture(scope="module")
def scripted():
    tokenizer = Tokenizer.from_pretrained(FIXTURES / "qwen3")
    runner = ScriptedRunner([], tokenizer.eos_token_id)
    template = (FIXTURES / "chat_templates" / "qwen3.jinja").read_text()
    ctx = build_context(
        FIXTURES / "qwen3",
        runner=runner,
        max_num_seqs=4,
        max_model_len=1024,
        options=ServerOptions(served_model_names=[MODEL], chat_template=template),
    )
    with LiveServer(ctx) as live:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
        yield ctx, runner, tokenizer, client


def _script(ctx, runner, tokenizer, tool_parser, reasoning_parser, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 8, "markers should span several tokens"
    runner.script = ScriptedRunner(ids, tokenizer.eos_token_id).script
    ctx.options.tool_parser = tool_parser
    ctx.options.reasoning_parser = reasoning_parser


@pytest.mark.parametrize("parser", sorted(CASES))
def test_tool_calls_and_reasoning_stream_and_not(scripted, parser):
    ctx, runner, tokenizer, client = scripted
    reasoning_parser, text, content, reasoning, calls = CASES[parser]
    _script(ctx, runner, tokenizer, parser, reasoning_parser, text)
    messages = [{"role": "user", "content": "Weather?"}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=400, temperature=0
    )
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    assert (message.content or "").strip() == content
    assert (getattr(message, "reasoning", None) or "").strip() == reasoning
    got = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert got == calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in message.tool_calls)

    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=400, temperature=0, stream=True
    )
    streamed_content, streamed_reasoning, finish = "", "", None
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            streamed_content += delta.content or ""
            extra = delta.model_extra or {}
            streamed_reasoning += extra.get("reasoning") or ""
            for call in delta.tool_calls or []:
                if call.function.name:
                    assert call.index not in names, "the name comes once per call"
                    names[call.index] = call.function.name
                    assert call.id.startswith("call_")
                arguments[call.index] = arguments.get(call.index, "") + (
                    call.function.arguments or ""
                )
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert streamed_content.strip() == content
    assert streamed_reasoning.strip() == reasoning
    assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == calls
    for marker in ("<tool", "<｜", "｜DSML｜", "<function", "<arg_", "</think>", '{"name"'):
        assert marker not in streamed_content and marker not in (message.content or "")


def test_tool_choice_none_leaves_markers_as_text(scripted):
    ctx, runner, tokenizer, client = scripted
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "SF"}}\n</tool_call>'
    _script(ctx, runner, tokenizer, "hermes", None, text)
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=400,
    )
    assert response.choices[0].message.content == text
    assert not response.choices[0].message.tool_calls
    assert response.choices[0].finish_reason == "stop"


def test_tool_history_round_trip_renders(scripted):
    """An assistant tool call (arguments as a JSON string) and its tool result render through
    the template, with a later system message demoted instead of rejected."""
    ctx, runner, tokenizer, client = scripted
    _script(ctx, runner, tokenizer, "hermes", "qwen3", "It is sunny.")
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in SF?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "SF"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
        {"role": "system", "content": "Answer in English."},
    ]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=50
    )
    assert response.choices[0].message.content == "It is sunny."
    assert response.choices[0].finish_reason == "stop"


def test_thinking_switched_off_by_the_template_disables_reasoning_parsing(scripted):
    """deepseek_r1 reads text before a missing </think> as reasoning; when the rendered prompt
    already closed the think block (enable_thinking=False), the output is all content."""
    ctx, runner, tokenizer, client = scripted
    _script(ctx, runner, tokenizer, None, "deepseek_r1", "Plain answer.")
    messages = [{"role": "user", "content": "hi"}]
    thinking = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=50)
    assert thinking.choices[0].message.content is None or thinking.choices[0].message.content == ""
    assert thinking.choices[0].message.model_extra["reasoning"] == "Plain answer."
    off = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=50,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.choices[0].message.content == "Plain answer."
    assert "reasoning" not in (off.choices[0].message.model_extra or {})


def test_a_call_cut_by_the_end_of_the_generation_is_not_a_finished_call(scripted):
    """A call the generation ends inside (max tokens, EOS mid-call, a stop string) is closed by
    the parser with what it had, but never presented as one the model finished: Responses marks
    its function_call item ``incomplete`` (Codex runs ``completed`` ones), chat does not say
    ``tool_calls``, Anthropic does not say ``tool_use`` (a stop string wins)."""
    import httpx

    ctx, runner, tokenizer, client = scripted
    base = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Reykjavik", "days": 3}}'
    _script(ctx, runner, tokenizer, "hermes", None, call + "\n</tool_call>")
    messages = [{"role": "user", "content": "Weather?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert whole.choices[0].finish_reason == "tool_calls"
    budget = len(tokenizer.encode(call, add_special_tokens=False)) - 3  # inside "Reykjavik"
    cut = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=budget
    )
    assert cut.choices[0].finish_reason == "length"
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    body = {"model": MODEL, "input": "Weather?", "tools": tools}
    full = httpx.post(f"{base}/v1/responses", json=body, timeout=30).json()
    assert full["status"] == "completed"
    assert [o["status"] for o in full["output"] if o["type"] == "function_call"] == ["completed"]
    body["max_output_tokens"] = budget
    partial = httpx.post(f"{base}/v1/responses", json=body, timeout=30).json()
    assert partial["status"] == "incomplete"
    items = [o for o in partial["output"] if o["type"] == "function_call"]
    assert [o["status"] for o in items] == ["incomplete"]
    # The model's own EOS inside the call: not "tool_calls" either.
    _script(ctx, runner, tokenizer, "hermes", None, call[:-12])
    eos = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert eos.choices[0].finish_reason == "stop"
    # Anthropic: a stop sequence met inside the call is the stop reason, with the sequence.
    _script(ctx, runner, tokenizer, "hermes", None, call + "\n</tool_call>")
    anthropic_tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    message = httpx.post(
        f"{base}/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 200,
            "messages": messages,
            "tools": anthropic_tools,
            "stop_sequences": ['"days"'],
        },
        timeout=30,
    ).json()
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", '"days"')
    whole_message = httpx.post(
        f"{base}/v1/messages",
        json={"model": MODEL, "max_tokens": 200, "messages": messages, "tools": anthropic_tools},
        timeout=30,
    ).json()
    assert whole_message["stop_reason"] == "tool_use"


def test_a_call_released_whole_at_the_end_is_a_finished_call(scripted):
    """A call the reasoning parser holds back until the end (it starts inside a ``<think>``
    that never closes: Qwen3.5 and GLM do this) comes out of the parser's finish() complete;
    it is a finished call, not a cut one."""
    ctx, runner, tokenizer, client = scripted
    text = (
        "<think>need the weather\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "SF"}}\n</tool_call>'
    )
    _script(ctx, runner, tokenizer, "hermes", "qwen3", text)
    messages = [{"role": "user", "content": "Weather?"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    choice = response.choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert choice.finish_reason == "tool_calls"


def test_no_parallel_calls_keeps_the_first_call_on_every_api(scripted):
    """parallel_tool_calls false (Chat, Responses) and disable_parallel_tool_use (Anthropic):
    a model writing two calls reports the first only, streamed and not (vLLM keeps the first)."""
    import anthropic
    import httpx

    ctx, runner, tokenizer, client = scripted
    _script(ctx, runner, tokenizer, "qwen3_coder", None, CASES["qwen3_coder"][1])  # two calls
    messages = [{"role": "user", "content": "Weather?"}]
    both = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert len(both.choices[0].message.tool_calls) == 2
    one = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, parallel_tool_calls=False
    )
    calls = one.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "SF", "days": 3}]
    assert one.choices[0].finish_reason == "tool_calls"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, parallel_tool_calls=False, stream=True
    )
    indices = {
        call.index
        for chunk in stream
        for choice in chunk.choices
        for call in choice.delta.tool_calls or []
    }
    assert indices == {0}
    base = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    response = httpx.post(
        f"{base}/v1/responses",
        json={
            "model": MODEL,
            "input": "Weather?",
            "tools": [{"type": "function", **TOOLS[0]["function"]}],
            "parallel_tool_calls": False,
        },
        timeout=60,
    ).json()
    assert [item["type"] for item in response["output"]] == ["function_call"]
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    message = claude.messages.create(
        model="claude-test",
        max_tokens=200,
        messages=messages,
        tools=[{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
    )
    assert [block.type for block in message.content] == ["tool_use"]
    assert message.stop_reason == "tool_use"
