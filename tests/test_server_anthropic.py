"""The Anthropic Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) end to end.

Clients are the official ``anthropic`` SDK (and raw httpx for malformed bodies) against live
uvicorn servers running in a background thread:

- ``tiny``: the qwen3 fixture checkpoint on the torch runner — greedy text must equal
  ``resin.llm.LLM.chat`` for the same conversation; usage, stop sequences, clamping, errors.
- ``scripted``: a :class:`ScriptedRunner` that writes a fixed ``<think>`` + text + ``<tool_call>``
  output (markers split across tokens by the byte-level BPE) under the Qwen3 template, which
  renders tools — thinking / tool_use blocks, streamed and not. Its runner is wrapped so a test
  can make it fail mid-generation or run slowly without end (disconnect → abort).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from resin import SamplingParams
from resin.llm import LLM
from resin.runners.scripted import CyclingRunner, ScriptedRunner
from resin.server.anthropic import messages as messages_module
from resin.server.anthropic.blocks import BlockWriter
from resin.server.anthropic.convert import build_prompt
from resin.server.context import ServerContext, ServerOptions
from resin.server.parsers import (
    ContentDelta,
    OutputParser,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from resin.server.serve import build_context
from resin.tokenizer import Tokenizer
from tests.server_harness import LiveServer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MODEL_DIR = FIXTURES / "qwen3"
QWEN3_TEMPLATE = FIXTURES / "chat_templates" / "qwen3.jinja"
MODEL = "qwen3-tiny"
SCRIPT = (
    '<think>\nplan\n</think>\n\nSure.<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "SF"}}\n</tool_call>'
)
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
SERVER_TOOL = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
SYSTEM = "You are terse."
# the 2026 SDK dropped the sampling keywords from create(); clients send them as extra fields
GREEDY = {"temperature": 0.0}


@dataclass
class Server:
    ctx: ServerContext
    port: int
    client: anthropic.Anthropic
    http: httpx.Client

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class ControlledRunner:
    """A ScriptedRunner whose behaviour a test can switch: ``fail_after`` (raise on the Nth
    forward from now), ``endless`` (emit a non-EOS cycle forever) and ``delay`` (seconds per
    forward). Both inner runners see every plan, so their per-request state stays right."""

    def __init__(self, scripted: ScriptedRunner, cycling: CyclingRunner) -> None:
        self.scripted = scripted
        self.cycling = cycling
        self.fail_after: int | None = None
        self.endless = False
        self.delay = 0.0

    def forward(self, plan: Any) -> Any:
        scripted = self.scripted.forward(plan)
        cycling = self.cycling.forward(plan)
        if self.delay:
            time.sleep(self.delay)
        if self.fail_after is not None:
            self.fail_after -= 1
            if self.fail_after <= 0:
                self.fail_after = None
                raise RuntimeError("injected runner failure")
        return cycling if self.endless else scripted


def _serve(ctx: ServerContext) -> Iterator[Server]:
    with LiveServer(ctx) as live:
        client = anthropic.Anthropic(base_url=live.base_url, api_key="x", max_retries=0, timeout=60)
        http = httpx.Client(base_url=live.base_url, timeout=60)
        try:
            yield Server(ctx, live.port, client, http)
        finally:
            http.close()
            client.close()


@pytest.fixture(scope="module")
def tiny() -> Iterator[Server]:
    ctx = build_context(
        MODEL_DIR, runner="torch", options=ServerOptions(served_model_names=[MODEL]), max_num_seqs=8
    )
    yield from _serve(ctx)


@pytest.fixture(scope="module")
def runner() -> ControlledRunner:
    tokenizer = Tokenizer.from_pretrained(MODEL_DIR)
    cycle = [
        t
        for t in tokenizer.encode(" the quick brown fox", add_special_tokens=False)
        if t not in tokenizer.eos_token_ids
    ]
    return ControlledRunner(
        ScriptedRunner(
            tokenizer.encode(SCRIPT, add_special_tokens=False), tokenizer.eos_token_ids[0]
        ),
        CyclingRunner(cycle),
    )


@pytest.fixture(scope="module")
def scripted(runner: ControlledRunner) -> Iterator[Server]:
    options = ServerOptions(
        served_model_names=[MODEL], chat_template=QWEN3_TEMPLATE.read_text(encoding="utf-8")
    )
    ctx = build_context(
        MODEL_DIR, runner=runner, options=options, max_num_seqs=8, max_model_len=2048
    )
    yield from _serve(ctx)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL_DIR)


@pytest.fixture(autouse=True)
def _reset_runner(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "runner" in request.fixturenames:
        control = request.getfixturevalue("runner")
        control.fail_after, control.endless, control.delay = None, False, 0.0


def _text(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def _reference(llm: LLM, max_tokens: int) -> Any:
    conversation = [{"role": "system", "content": SYSTEM}, *HELLO]
    return llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0]


def _expected_stop_reason(finish_reason: str | None) -> str:
    return "max_tokens" if finish_reason == "length" else "end_turn"


# -- text generation on the real model --------------------------------------------------------
def test_create_matches_llm_chat(tiny: Server, llm: LLM) -> None:
    reference = _reference(llm, 24)
    message = tiny.client.messages.create(
        model=MODEL, max_tokens=24, system=SYSTEM, messages=HELLO, extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and len(message.id) >= 28
    assert message._request_id is not None and message._request_id.startswith("req_")
    assert message.model == MODEL
    assert _text(message) == reference.text
    assert message.stop_reason == _expected_stop_reason(reference.finish_reason)
    assert message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(reference.prompt_token_ids)
    assert usage.cache_creation_input_tokens == 0
    assert usage.output_tokens == len(reference.token_ids)


def test_repeat_reads_the_prefix_cache(tiny: Server, llm: LLM) -> None:
    num_prompt = len(_reference(llm, 1).prompt_token_ids)
    for _ in range(2):
        message = tiny.client.messages.create(
            model=MODEL, max_tokens=4, system=SYSTEM, messages=HELLO, extra_body=GREEDY
        )
        usage = message.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == num_prompt
    # the second request found the first one's full pages: cache reads are not input_tokens
    assert usage.cache_read_input_tokens > 0
    assert usage.input_tokens == num_prompt - usage.cache_read_input_tokens


def test_stream_matches_llm_chat(tiny: Server, llm: LLM) -> None:
    reference = _reference(llm, 24)
    with tiny.client.messages.stream(
        model=MODEL, max_tokens=24, system=SYSTEM, messages=HELLO, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert events[0].type == "message_start"
    assert events[0].message.usage.input_tokens + events[
        0
    ].message.usage.cache_read_input_tokens == len(reference.prompt_token_ids)
    assert [e.type for e in events[-2:]] == ["message_delta", "message_stop"]
    assert _text(final) == reference.text
    assert final.model == MODEL
    assert final.stop_reason == _expected_stop_reason(reference.finish_reason)
    assert final.usage.output_tokens == len(reference.token_ids)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(
        reference.prompt_token_ids
    )
    deltas = "".join(
        e.delta.text
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "text_delta"
    )
    assert deltas == reference.text


def test_count_tokens_equals_prompt_length(tiny: Server, llm: LLM) -> None:
    reference = _reference(llm, 1)
    counted = tiny.client.beta.messages.count_tokens(model=MODEL, system=SYSTEM, messages=HELLO)
    assert counted.input_tokens == len(reference.prompt_token_ids)
    # Claude Code's per-request billing block is dropped before rendering
    blocks = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=a5145;"},
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
    ]
    counted = tiny.client.beta.messages.count_tokens(
        model="claude-haiku-4-5", system=blocks, messages=HELLO
    )
    assert counted.input_tokens == len(reference.prompt_token_ids)


def test_mid_conversation_system_betas_and_unknown_fields(tiny: Server, llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hello"}, {"role": "system", "content": "Be brief."}]
    demoted = [
        {"role": "user", "content": "Hello\n\n<system-reminder>\nBe brief.\n</system-reminder>"}
    ]
    reference = llm.chat(demoted, SamplingParams(temperature=0.0, max_tokens=8))[0]
    message = tiny.client.messages.create(
        model="claude-opus-4-7",
        max_tokens=8,
        messages=messages,
        metadata={"user_id": "u1"},
        extra_headers={
            "anthropic-beta": "claude-code-20250219,mid-conversation-system-2026-04-07,"
            "interleaved-thinking-2025-05-14,no-such-beta-2099-01-01"
        },
        extra_body={
            "temperature": 0.0,
            "top_k": 5,
            "top_p": 0.9,
            "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
            "output_config": {"effort": "high"},
            "speed": "fast",
        },
    )
    assert message.model == "claude-opus-4-7"
    assert _text(message) == reference.text
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(
        reference.prompt_token_ids
    )


def test_stop_sequences(tiny: Server, llm: LLM) -> None:
    full = _reference(llm, 24).text
    start = next((i for i in range(3, len(full) - 2) if full[:i].strip()), None)
    if start is None:
        pytest.fail(f"the fixture's greedy output is too short for this test: {full!r}")
    stop = full[start : start + 2]
    expected = full[: full.find(stop)]
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 24,
        "system": SYSTEM,
        "messages": HELLO,
        "extra_body": GREEDY,
        "stop_sequences": [stop, "never-appears-xyz"],
    }
    message = tiny.client.messages.create(**kwargs)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert _text(message) == expected
    with tiny.client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert _text(final) == expected


def test_max_tokens_over_the_context_is_clamped(tiny: Server) -> None:
    # a long prompt leaves little room, so running to the end of the context is quick
    messages = [{"role": "user", "content": "Hello there " * 115}]
    num_prompt = tiny.client.beta.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    room = tiny.ctx.max_model_len - num_prompt
    assert 0 < room < 100
    kwargs: dict[str, Any] = {"model": "claude-opus-4-7", "max_tokens": 64000, "messages": messages}
    with tiny.client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    for message in (tiny.client.messages.create(**kwargs), streamed):
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == num_prompt
        assert 0 < message.usage.output_tokens <= room
        # the clamp (not the client's 64000) ended it: not "max_tokens", which Claude Code
        # reports as "exceeded the 64000 output token maximum"
        if message.stop_reason == "model_context_window_exceeded":
            assert message.usage.output_tokens == room
        else:
            assert message.stop_reason == "end_turn"
            assert message.usage.output_tokens < room


def test_prompt_over_the_context_is_400(tiny: Server) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        tiny.client.messages.create(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "word " * 600}]
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "prompt is too long" in info.value.body["error"]["message"]


def test_unknown_model_is_404(tiny: Server) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        tiny.client.messages.create(model="gpt-4o", max_tokens=5, messages=HELLO)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "not_found_error"


BAD_REQUESTS: list[tuple[str, Any, int, str]] = [
    ("missing max_tokens", {"model": MODEL, "messages": HELLO}, 400, "max_tokens"),
    ("max_tokens 0", {"model": MODEL, "max_tokens": 0, "messages": HELLO}, 400, "max_tokens"),
    (
        "max_tokens string",
        {"model": MODEL, "max_tokens": "ten", "messages": HELLO},
        400,
        "max_tokens",
    ),
    ("messages not a list", {"model": MODEL, "max_tokens": 5, "messages": "hi"}, 400, "messages"),
    ("empty messages", {"model": MODEL, "max_tokens": 5, "messages": []}, 400, "messages"),
    (
        "bad role",
        {"model": MODEL, "max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]},
        400,
        "role",
    ),
    (
        "content a number",
        {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": 7}]},
        400,
        "content",
    ),
    (
        "block without type",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"text": "hi"}]}],
        },
        400,
        "type",
    ),
    (
        "image block",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
                        },
                        {"type": "text", "text": "what is this?"},
                    ],
                }
            ],
        },
        400,
        "text only",
    ),
    (
        "document block",
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {"type": "text", "media_type": "text/plain", "data": "x"},
                        }
                    ],
                }
            ],
        },
        400,
        "text only",
    ),
    (
        "temperature over 1",
        {"model": MODEL, "max_tokens": 5, "messages": HELLO, "temperature": 1.5},
        400,
        "temperature",
    ),
    (
        "stream not a bool",
        {"model": MODEL, "max_tokens": 5, "messages": HELLO, "stream": "yes"},
        400,
        "stream",
    ),
    (
        "system a number",
        {"model": MODEL, "max_tokens": 5, "messages": HELLO, "system": 3},
        400,
        "system",
    ),
    (
        "tools not a list",
        {"model": MODEL, "max_tokens": 5, "messages": HELLO, "tools": {}},
        400,
        "tools",
    ),
    (
        "tool_choice unknown type",
        {"model": MODEL, "max_tokens": 5, "messages": HELLO, "tool_choice": {"type": "sometimes"}},
        400,
        "tool_choice",
    ),
    (
        "tool_choice any without tools",
        {"model": MODEL, "max_tokens": 5, "messages": HELLO, "tool_choice": {"type": "any"}},
        400,
        '{"type": "any"} needs at least one tool',
    ),
    ("missing model", {"max_tokens": 5, "messages": HELLO}, 400, "model"),
    ("unknown model", {"model": "llama-70b", "max_tokens": 5, "messages": HELLO}, 404, "llama-70b"),
    ("invalid JSON", b'{"model": "qwen3-tiny", "max_tokens": 5,', 400, "JSON"),
    ("body not an object", b"[1, 2]", 400, "object"),
]


@pytest.mark.parametrize(
    "body,status,needle",
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_malformed_requests(tiny: Server, body: Any, status: int, needle: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    for path in ("/v1/messages", "/v1/messages?beta=true"):
        response = tiny.http.post(
            path,
            content=content,
            headers={
                "content-type": "application/json",
                "x-api-key": "x",
                "anthropic-version": "2023-06-01",
            },
        )
        assert response.status_code == status, response.text
        error = response.json()
        assert error["type"] == "error"
        assert error["request_id"].startswith("req_")
        expected_type = "not_found_error" if status == 404 else "invalid_request_error"
        assert error["error"]["type"] == expected_type
        assert needle.lower() in error["error"]["message"].lower(), error


def test_serving_after_malformed_requests(tiny: Server) -> None:
    for _, body, _, _ in BAD_REQUESTS:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        assert tiny.http.post("/v1/messages", content=content).status_code in (400, 404)
    message = tiny.client.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert message.usage.output_tokens == 2
    with tiny.client.messages.stream(model=MODEL, max_tokens=2, messages=HELLO) as stream:
        assert stream.get_final_message().usage.output_tokens == 2


def test_count_tokens_errors(tiny: Server) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        tiny.client.beta.messages.count_tokens(
            model=MODEL,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "url", "url": "http://example.invalid/x.png"},
                        }
                    ],
                }
            ],
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        tiny.client.beta.messages.count_tokens(model="gpt-4o", messages=HELLO)


# -- thinking and tool_use on the scripted runner -------------------------------------------
TOOL_REQUEST: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 200,
    "tools": [WEATHER_TOOL, SERVER_TOOL],
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "messages": [{"role": "user", "content": "Weather in SF?"}],
}


def _check_tool_message(message: Any) -> None:
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, tool_use = message.content
    assert thinking.thinking == "plan"
    assert thinking.signature
    assert text.text == "Sure."
    assert tool_use.id.startswith("toolu_")
    assert (tool_use.name, tool_use.input) == ("get_weather", {"city": "SF"})
    assert (message.stop_reason, message.stop_sequence) == ("tool_use", None)
    assert (
        message.usage.output_tokens
        == len(Tokenizer.from_pretrained(MODEL_DIR).encode(SCRIPT, add_special_tokens=False)) + 1
    )  # the script, then EOS


def test_tool_use_and_thinking_non_stream(scripted: Server) -> None:
    message = scripted.client.messages.create(**TOOL_REQUEST)
    _check_tool_message(message)


def test_tool_use_and_thinking_stream(scripted: Server, runner: ControlledRunner) -> None:
    runner.delay = 0.01  # one engine step per dispatch: the output arrives in many deltas
    with scripted.client.messages.stream(**TOOL_REQUEST) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert sum(e.type == "content_block_delta" for e in events) >= 5
    _check_tool_message(final)
    raw = [
        e
        for e in events
        if e.type
        in (
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        )
    ]
    assert raw[0].type == "message_start" and raw[-1].type == "message_stop"
    open_index: int | None = None
    next_index = 0
    kinds: dict[int, str] = {}
    last_delta: dict[int, str] = {}
    partial: dict[int, str] = {}
    for event in raw[1:-2]:
        if event.type == "content_block_start":
            assert open_index is None, "a block opened while another was open"
            assert event.index == next_index
            open_index, next_index = event.index, next_index + 1
            kinds[event.index] = event.content_block.type
        elif event.type == "content_block_delta":
            assert event.index == open_index
            last_delta[event.index] = event.delta.type
            if event.delta.type == "input_json_delta":
                partial[event.index] = partial.get(event.index, "") + event.delta.partial_json
        else:
            assert event.index == open_index
            open_index = None
    assert open_index is None
    assert kinds == {0: "thinking", 1: "text", 2: "tool_use"}
    assert last_delta[0] == "signature_delta"
    assert json.loads(partial[2]) == {"city": "SF"}
    assert raw[-2].delta.stop_reason == "tool_use"


def test_tool_choice_none_leaves_markup_as_text(scripted: Server) -> None:
    message = scripted.client.messages.create(**{**TOOL_REQUEST, "tool_choice": {"type": "none"}})
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert "<tool_call>" in message.content[1].text
    assert message.stop_reason == "end_turn"


def test_tool_choice_naming_an_unknown_tool_is_400(scripted: Server) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        scripted.client.messages.create(
            **{**TOOL_REQUEST, "tool_choice": {"type": "tool", "name": "nope"}}
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"


def test_history_conversion_renders_through_the_template(scripted: Server) -> None:
    body = {
        "model": MODEL,
        "tools": [WEATHER_TOOL, SERVER_TOOL],
        "tool_choice": {"type": "any"},
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cch=00000;"},
            {"type": "text", "text": "Be helpful."},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in SF?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "need a tool", "signature": "abc"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "SF"},
                    },
                    {
                        "type": "server_tool_use",
                        "id": "srvtoolu_1",
                        "name": "web_search",
                        "input": {"query": "sf"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "is_error": True,
                        "content": [
                            {"type": "text", "text": "boom"},
                            {"type": "tool_reference", "tool_name": "get_weather"},
                        ],
                    },
                    {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
                    {
                        "type": "search_result",
                        "source": "kb",
                        "title": "t",
                        "content": [{"type": "text", "text": "found it"}],
                    },
                    {"type": "container_upload", "file_id": "file_1"},
                    {"type": "text", "text": "Try again."},
                ],
            },
            {"role": "system", "content": [{"type": "text", "text": "Reminder."}]},
        ],
    }
    prompt, tool_choice = build_prompt(scripted.ctx, body)
    text = prompt.text
    assert tool_choice == "required"
    assert "billing" not in text and text.startswith("<|im_start|>system\nBe helpful.\n\n# Tools")
    assert '"name": "get_weather"' in text and "web_search" not in text
    # the template shows earlier turns' reasoning only after the last real user query
    assert (
        "<|im_start|>user\nWeather in SF?<|im_end|>\n<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "SF"}}\n</tool_call>'
        "<|im_end|>"
    ) in text
    assert "opaque" not in text and "srvtoolu" not in text
    assert (
        "<|im_start|>user\n<tool_response>\nError: boom\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nfound it\nTry again.\n\n<system-reminder>\nReminder.\n</system-reminder>"
        "<|im_end|>\n<|im_start|>assistant\n"
    ) in text
    counted = scripted.client.beta.messages.count_tokens(**body)
    assert counted.input_tokens == len(prompt.token_ids)


def test_thinking_history_becomes_reasoning_content(scripted: Server) -> None:
    body = {
        "model": MODEL,
        "tools": [WEATHER_TOOL],
        "messages": [
            {"role": "user", "content": "Weather in SF?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "need a tool", "signature": "abc"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "SF"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}],
            },
        ],
    }
    prompt, _ = build_prompt(scripted.ctx, body)
    assert prompt.text.endswith(
        "<|im_start|>assistant\n<think>\nneed a tool\n</think>\n\nChecking.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "SF"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_thinking_switch_reaches_the_template(scripted: Server) -> None:
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    off, _ = build_prompt(scripted.ctx, {**base, "thinking": {"type": "disabled"}})
    on, _ = build_prompt(scripted.ctx, {**base, "thinking": {"type": "adaptive"}})
    assert off.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.text.endswith("<|im_start|>assistant\n")
    # explicit chat_template_kwargs win over the thinking switch
    forced, _ = build_prompt(
        scripted.ctx,
        {
            **base,
            "thinking": {"type": "disabled"},
            "chat_template_kwargs": {"enable_thinking": True},
        },
    )
    assert forced.text == on.text


def test_max_tokens_cuts_a_tool_call(scripted: Server) -> None:
    message = scripted.client.messages.create(**{**TOOL_REQUEST, "max_tokens": 12})
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 12
    assert [block.type for block in message.content][:1] == ["thinking"]


def test_runner_failure_mid_stream_is_an_error_event(
    scripted: Server, runner: ControlledRunner
) -> None:
    runner.fail_after = 4
    with (
        pytest.raises(anthropic.APIStatusError) as info,
        scripted.client.messages.stream(**TOOL_REQUEST) as stream,
    ):
        for _ in stream:
            pass
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "api_error"
    assert "injected runner failure" in info.value.body["error"]["message"]
    runner.fail_after = 2
    with pytest.raises(anthropic.InternalServerError) as info:
        scripted.client.messages.create(**TOOL_REQUEST)
    assert info.value.body["error"]["type"] == "api_error"
    _check_tool_message(scripted.client.messages.create(**TOOL_REQUEST))  # still serving


def test_client_disconnect_aborts_the_generation(
    scripted: Server, runner: ControlledRunner
) -> None:
    runner.endless, runner.delay = True, 0.01
    loop = scripted.ctx.loop
    body = {**TOOL_REQUEST, "stream": True, "max_tokens": 1500}
    with httpx.stream(
        "POST", scripted.url + "/v1/messages", json=body, timeout=30, headers={"x-api-key": "x"}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        assert next(lines) == "event: message_start"
        assert loop.num_active_requests == 1
    deadline = time.monotonic() + 10
    while loop.num_active_requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loop.num_active_requests == 0


def test_pings_while_nothing_else_is_sent(
    scripted: Server, runner: ControlledRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(messages_module, "PING_INTERVAL_S", 0.05)
    runner.delay = 0.15
    body = {**TOOL_REQUEST, "stream": True, "max_tokens": 5}
    with scripted.http.stream("POST", "/v1/messages", json=body) as response:
        text = response.read().decode()
    events = [chunk.split("\n")[0] for chunk in text.split("\n\n") if chunk]
    assert events.count("event: ping") >= 2
    assert 'data: {"type":"ping"}' in text
    others = [e for e in events if e != "event: ping"]
    assert others[0] == "event: message_start" and others[-1] == "event: message_stop"


# -- block assembly edge cases ----------------------------------------------------------------
def _replay(wire: list[str]) -> list[dict[str, Any]]:
    """Rebuild the content blocks from SSE text as a client would, checking the invariants."""
    blocks: list[dict[str, Any]] = []
    open_index = None
    partial: dict[int, str] = {}
    for chunk in wire:
        name, data = chunk.split("\n")[:2]
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}" and chunk.endswith("\n\n")
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == len(blocks)
            open_index = event["index"]
            blocks.append(dict(event["content_block"]))
            continue
        assert event["index"] == open_index
        block = blocks[open_index]
        if event["type"] == "content_block_stop":
            open_index = None
            if block["type"] == "tool_use":
                block["input"] = json.loads(partial.get(event["index"], "{}"))
            continue
        delta = event["delta"]
        if delta["type"] == "thinking_delta":
            block["thinking"] += delta["thinking"]
        elif delta["type"] == "signature_delta":
            block["signature"] = delta["signature"]
        elif delta["type"] == "text_delta":
            block["text"] += delta["text"]
        else:
            partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
    assert open_index is None
    return blocks


def _without_ids(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.items() if k not in ("id", "signature")} for b in blocks]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
def test_block_writer_same_blocks_for_any_split(chunk: int) -> None:
    text = (
        "<think>\n plan\n\n more\n</think>\n\nSure.\n\n"
        + SCRIPT.split("Sure.")[1]
        + '\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    parser = OutputParser("hermes", "qwen3", tools=tools)
    writer = BlockWriter()
    wire: list[str] = []
    for at in range(0, len(text), chunk):
        wire += writer.feed(parser.feed(text[at : at + chunk]))
    wire += writer.feed(parser.finish())
    wire += writer.finish()
    content = writer.content()
    assert _replay(wire) == content
    assert _without_ids(content) == [
        {"type": "thinking", "thinking": "plan\n\n more"},
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "SF"}},
        {"type": "tool_use", "name": "get_weather", "input": {}},
    ]


def test_block_writer_orders_and_closes_blocks() -> None:
    writer = BlockWriter()
    wire = writer.feed(
        [
            ReasoningDelta("\n"),
            ReasoningDelta("a\n"),
            ContentDelta("\n\n"),
            ContentDelta("hi"),
            ReasoningDelta("b"),
            ContentDelta("\n"),
            ToolCallStart(0, "call_1", "f"),
            ToolCallArgumentsDelta(0, '{"x": '),
            ToolCallArgumentsDelta(0, "1}"),
            ToolCallEnd(0, '{"x": 1}'),
            ContentDelta("  "),
            ContentDelta(" end \n"),
        ]
    )
    wire += writer.finish()
    content = writer.content()
    assert [b["type"] for b in content] == ["thinking", "text", "thinking", "tool_use", "text"]
    assert content[0]["thinking"] == "a" and content[1]["text"] == "hi"
    assert content[3] == {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}}
    assert content[4]["text"] == "end \n"  # the final text keeps its trailing whitespace
    assert all(b["signature"] for b in content if b["type"] == "thinking")
    assert _replay(wire) == content


@pytest.mark.parametrize("arguments", ['{"x": 1', "[1, 2]", "", "null"])
def test_block_writer_tool_input_that_is_no_object_is_empty(arguments: str) -> None:
    writer = BlockWriter()
    writer.feed([ToolCallStart(0, "call_2", "f"), ToolCallEnd(0, arguments)])
    writer.finish()
    assert writer.content() == [{"type": "tool_use", "id": "toolu_2", "name": "f", "input": {}}]


def test_block_writer_whitespace_only_output_and_thinking() -> None:
    writer = BlockWriter()
    writer.feed([ContentDelta(" "), ContentDelta("\n")])
    writer.finish()
    assert writer.content() == [{"type": "text", "text": " \n"}]
    writer = BlockWriter()
    wire = writer.feed([ReasoningDelta("\n\n"), ContentDelta("\n\nHi")]) + writer.finish()
    assert writer.content() == [{"type": "text", "text": "\n\nHi"}]
    assert _replay(wire) == writer.content()


def test_a_final_assistant_message_is_a_prefill_the_answer_continues(scripted: Server) -> None:
    """Anthropic's prefill: the final assistant message is rendered open (no end of turn, no
    new generation prompt), as transformers' ``continue_final_message`` renders it; the chat
    endpoint takes vLLM's ``continue_final_message`` field for the same."""
    from resin.server.openai.chat import prepare_chat

    user = {"role": "user", "content": "hi"}
    body = {"model": MODEL, "max_tokens": 8, "messages": [user]}
    plain, _ = build_prompt(scripted.ctx, body)
    prefill = {"role": "assistant", "content": 'Sure: {"a":'}
    continued, _ = build_prompt(scripted.ctx, {**body, "messages": [user, prefill]})
    assert continued.text.endswith('Sure: {"a":')  # (Qwen3's template adds an empty think)
    assert continued.text.startswith(plain.text) and continued.text.count("<|im_end|>") == 1
    assert continued.reasoning_closed  # the continuation is content, not reasoning
    # a tool-use turn last is history, not a prefill
    tool_turn = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}],
    }
    closed, _ = build_prompt(scripted.ctx, {**body, "messages": [user, tool_turn]})
    assert closed.text.endswith("<|im_start|>assistant\n")
    chat = {"model": MODEL, "messages": [user, prefill], "continue_final_message": True}
    _, _, prompt, _ = prepare_chat(scripted.ctx, chat)
    assert prompt.text == continued.text
