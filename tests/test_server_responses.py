"""``POST /v1/responses`` end to end: the official ``openai`` SDK against live ``resin serve`` apps.

Two uvicorn servers run in background threads for the module:

- ``torch_server``: the tiny Qwen3 checkpoint on the torch runner, with the checkpoint's own
  chat template — greedy text must equal ``resin.LLM.chat`` for the same conversation, usage must
  count the same tokens, and the malformed-request table runs here;
- ``scripted_server``: a :class:`ScriptedRunner` that emits a fixed text (set per test) then EOS,
  rendered with ``tests/fixtures/chat_templates/qwen3.jinja`` (which renders tools), so tool
  calls, custom-tool calls, namespace tools and reasoning come out of the real parsers exactly
  as a model would send them. A switch makes its runner raise, for ``response.failed``.

Streams are checked event by event: the exact ordered types, ``sequence_number`` 0..N-1, and
deltas that concatenate to the ``.done`` values and to the final response.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

import resin
from resin.llm import LLM
from resin.runners.scripted import ScriptedRunner
from resin.server.context import ServerContext, ServerOptions
from resin.server.openai.responses_request import prepare_response
from resin.server.serve import build_context
from resin.tokenizer import Tokenizer
from tests.server_harness import LiveServer as HttpServer

REPO = Path(__file__).resolve().parent.parent
CHECKPOINT = REPO / "tests" / "fixtures" / "qwen3"
QWEN3_TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "qwen3.jinja"
MODEL = "qwen3-tiny"

SHELL_CALL = (
    '<think>\nplan\n</think>\n\n<tool_call>\n{"name": "shell", "arguments": '
    '{"command": ["ls"]}}\n</tool_call>'
)
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
PATCH_CALL = (
    '<tool_call>\n{"name": "apply_patch", "arguments": {"input": '
    + json.dumps(PATCH)
    + "}}\n</tool_call>"
)
NAMESPACE_CALL = (
    'Looking it up.<tool_call>\n{"name": "mcp__lookup", "arguments": '
    '{"query": "resin"}}\n</tool_call>'
)
ANSWER = "<think>\nthe user says hi\n</think>\n\nHello there!"

SHELL_TOOL = {
    "type": "function",
    "name": "shell",
    "description": "Run a command.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
        "required": ["command"],
    },
}
PATCH_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
}
NAMESPACE_TOOL = {
    "type": "namespace",
    "name": "mcp",
    "description": "MCP server tools",
    "tools": [
        {
            "type": "function",
            "name": "lookup",
            "description": "Look up.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        }
    ],
}
TOOLS = [
    SHELL_TOOL,
    PATCH_TOOL,
    NAMESPACE_TOOL,
    {"type": "web_search"},
    {"type": "local_shell"},
    {"type": "tool_search"},
]

TEXT_STREAM_HEAD = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
TEXT_ITEM_TAIL = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
REASONING_ITEM = [
    "response.output_item.added",
    "response.content_part.added",
    "response.reasoning_text.delta",
    "response.reasoning_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
MESSAGE_ITEM = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
FUNCTION_ITEM = [
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
]
CUSTOM_ITEM = [
    "response.output_item.added",
    "response.custom_tool_call_input.delta",
    "response.custom_tool_call_input.done",
    "response.output_item.done",
]


class SwitchableRunner(ScriptedRunner):
    """A ScriptedRunner whose script a test can replace, and which raises when told to."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_ids[0]
        self.fail = False
        self.delay_s = 0.0
        super().__init__(self.encode(SHELL_CALL), self.eos)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def set_script(self, text: str) -> None:
        self.script = np.asarray(self.encode(text) + [self.eos], dtype=np.uint32)

    def forward(self, plan: Any) -> Any:
        if self.fail:
            raise RuntimeError("injected runner failure")
        if self.delay_s:
            time.sleep(self.delay_s)
        return super().forward(plan)


@dataclass
class LiveServer:
    ctx: ServerContext
    url: str
    client: openai.OpenAI


def _serve(ctx: ServerContext) -> Iterator[LiveServer]:
    with HttpServer(ctx) as live:
        client = openai.OpenAI(
            base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0, timeout=60
        )
        try:
            yield LiveServer(ctx, live.base_url, client)
        finally:
            client.close()


@pytest.fixture(scope="module")
def torch_server() -> Iterator[LiveServer]:
    ctx = build_context(
        CHECKPOINT,
        runner="torch",
        options=ServerOptions(served_model_names=[MODEL]),
        max_num_seqs=8,
    )
    yield from _serve(ctx)


@pytest.fixture(scope="module")
def scripted_runner() -> SwitchableRunner:
    return SwitchableRunner(Tokenizer.from_pretrained(CHECKPOINT))


@pytest.fixture(scope="module")
def scripted_server(scripted_runner: SwitchableRunner) -> Iterator[LiveServer]:
    options = ServerOptions(
        served_model_names=[MODEL], chat_template=QWEN3_TEMPLATE.read_text(encoding="utf-8")
    )
    ctx = build_context(
        CHECKPOINT, runner=scripted_runner, options=options, max_num_seqs=8, max_model_len=8192
    )
    yield from _serve(ctx)


@pytest.fixture
def script(scripted_runner: SwitchableRunner) -> Iterator[SwitchableRunner]:
    yield scripted_runner
    scripted_runner.fail = False
    scripted_runner.delay_s = 0.0
    scripted_runner.set_script(SHELL_CALL)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(CHECKPOINT)


def _events(stream: Any) -> list[Any]:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def _types(events: list[Any]) -> list[str]:
    """Event types with runs of the same delta type collapsed to one."""
    result: list[str] = []
    for event in events:
        if not (event.type.endswith(".delta") and result and result[-1] == event.type):
            result.append(event.type)
    return result


def _check_usage(
    usage: Any, input_tokens: int, output_tokens: int, reasoning_tokens: int = 0
) -> None:
    assert usage.input_tokens == input_tokens
    assert usage.output_tokens == output_tokens
    assert usage.total_tokens == input_tokens + output_tokens
    assert usage.output_tokens_details.reasoning_tokens == reasoning_tokens
    assert isinstance(usage.input_tokens_details.cached_tokens, int)


# -- text, through the torch runner --------------------------------------------------------------

CONVERSATION = {"instructions": "You are terse.", "input": "Name three colours."}
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


def test_text_response_equals_llm_chat(torch_server: LiveServer, llm: LLM) -> None:
    expected = llm.chat(MESSAGES, resin.SamplingParams(temperature=0.0, max_tokens=24))[0]
    response = torch_server.client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=24, **CONVERSATION
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL and response.error is None
    assert len(response.output) == 1
    message = response.output[0]
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.role == "assistant"
    assert [part.type for part in message.content] == ["output_text"]
    assert response.output_text == expected.text
    assert message.content[0].annotations == []
    if expected.finish_reason == "length":
        assert response.status == "incomplete" and message.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and message.status == "completed"
        assert response.incomplete_details is None
    _check_usage(response.usage, len(expected.prompt_token_ids), len(expected.token_ids))
    raw = response.model_dump()
    assert raw["store"] is False and raw["previous_response_id"] is None
    assert raw["max_output_tokens"] == 24 and raw["temperature"] == 0.0
    # Settings are echoed as given (the engine keeps float32: 0.3 read 0.30000001192092896).
    echoed = torch_server.client.responses.create(
        model=MODEL, temperature=0.3, top_p=0.9, max_output_tokens=2, **CONVERSATION
    )
    assert (echoed.temperature, echoed.top_p) == (0.3, 0.9)
    assert set(raw["usage"]) >= {
        "input_tokens",
        "input_tokens_details",
        "output_tokens",
        "output_tokens_details",
        "total_tokens",
    }


def test_text_stream_events(torch_server: LiveServer, llm: LLM) -> None:
    expected = llm.chat(MESSAGES, resin.SamplingParams(temperature=0.0, max_tokens=24))[0]
    events = _events(
        torch_server.client.responses.create(
            model=MODEL, temperature=0, max_output_tokens=24, stream=True, **CONVERSATION
        )
    )
    terminal = "response.incomplete" if expected.finish_reason == "length" else "response.completed"
    assert _types(events) == TEXT_STREAM_HEAD + ["response.output_text.delta"] + TEXT_ITEM_TAIL + [
        terminal
    ]
    created, in_progress = events[0].response, events[1].response
    assert created.status == in_progress.status == "in_progress" and created.output == []
    final = events[-1].response
    assert created.id == final.id and final.id.startswith("resp_")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    text_done = next(e for e in events if e.type == "response.output_text.done")
    item_done = next(e for e in events if e.type == "response.output_item.done")
    assert deltas == text_done.text == expected.text
    assert item_done.item.content[0].text == expected.text
    assert final.output_text == expected.text
    assert final.output[0].id == item_done.item.id == events[2].item.id
    _check_usage(final.usage, len(expected.prompt_token_ids), len(expected.token_ids))


def test_stream_helper_final_response(
    scripted_server: LiveServer, script: SwitchableRunner
) -> None:
    script.set_script(ANSWER)
    with scripted_server.client.responses.stream(model=MODEL, input="hi") as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == "Hello there!"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.status == "completed"
    assert final.usage.output_tokens == len(script.encode(ANSWER)) + 1  # + EOS


def test_logprobs(torch_server: LiveServer, llm: LLM) -> None:
    params = resin.SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    expected = llm.chat(MESSAGES, params)[0]
    request = dict(
        model=MODEL,
        temperature=0,
        max_output_tokens=8,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
        **CONVERSATION,
    )
    response = torch_server.client.responses.create(**request)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == len(expected.token_ids) == 8
    for entry, token_id, reference in zip(logprobs, expected.token_ids, expected.logprobs):
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(reference[token_id], abs=1e-4)
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-6)
    events = _events(torch_server.client.responses.create(stream=True, **request))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in logprobs]
    assert [lp.logprob for lp in done.logprobs] == pytest.approx(
        [lp.logprob for lp in logprobs], abs=1e-4
    )
    assert [lp.token for lp in streamed] == [lp.token for lp in done.logprobs][: len(streamed)]
    assert streamed, "no output_text.delta carried logprobs"


def test_wire_format_is_named_sse_events(torch_server: LiveServer) -> None:
    body = {
        "model": MODEL,
        "input": "hi",
        "max_output_tokens": 4,
        "stream": True,
        "temperature": 0,
        "tools": [],
        "tool_choice": "auto",
    }
    with httpx.stream("POST", f"{torch_server.url}/v1/responses", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        raw = "".join(reply.iter_text())
    blocks = raw.split("\n\n")
    assert blocks[-1] == ""
    for number, block in enumerate(blocks[:-1]):
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        data = json.loads(data_line[len("data: ") :])
        assert data["type"] == event_line[len("event: ") :]
        assert data["sequence_number"] == number
    assert data["type"] in ("response.completed", "response.incomplete")
    usage = data["response"]["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= 0
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0


# -- tools and reasoning, through the scripted runner ---------------------------------------------


def _reasoning_tokens(server: LiveServer, text: str) -> int:
    return len(server.ctx.tokenizer.encode(text, add_special_tokens=False))


def test_function_call_non_stream(scripted_server: LiveServer, script: SwitchableRunner) -> None:
    response = scripted_server.client.responses.create(
        model=MODEL, input="list the files", tools=TOOLS, tool_choice="auto"
    )
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    reasoning, call = response.output
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [c.type for c in reasoning.content] == ["reasoning_text"]
    assert reasoning.content[0].text.strip() == "plan"
    assert reasoning.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "shell" and call.status == "completed"
    assert json.loads(call.arguments) == {"command": ["ls"]}
    assert getattr(call, "namespace", None) is None
    _check_usage(
        response.usage,
        response.usage.input_tokens,
        len(script.encode(SHELL_CALL)) + 1,
        _reasoning_tokens(scripted_server, reasoning.content[0].text),
    )
    assert response.usage.output_tokens_details.reasoning_tokens > 0


def test_function_call_stream(scripted_server: LiveServer, script: SwitchableRunner) -> None:
    events = _events(
        scripted_server.client.responses.create(
            model=MODEL, input="list the files", tools=TOOLS, stream=True
        )
    )
    assert _types(events) == [
        "response.created",
        "response.in_progress",
    ] + REASONING_ITEM + FUNCTION_ITEM + ["response.completed"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.type for item in done] == ["reasoning", "function_call"]
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    arguments_done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert arguments == arguments_done.arguments == done[1].arguments
    assert json.loads(done[1].arguments) == {"command": ["ls"]}
    assert done[1].name == "shell" and done[1].status == "completed"
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.output_index for e in added] == [0, 1]
    assert added[1].item.arguments == "" and added[1].item.call_id == done[1].call_id
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == done[0].content[0].text and reasoning.strip() == "plan"
    final = events[-1].response
    assert [item.model_dump() for item in final.output] == [item.model_dump() for item in done]
    assert final.usage.output_tokens_details.reasoning_tokens == _reasoning_tokens(
        scripted_server, reasoning
    )


def test_custom_tool_call_returns_raw_input(
    scripted_server: LiveServer, script: SwitchableRunner
) -> None:
    script.set_script(PATCH_CALL)
    response = scripted_server.client.responses.create(
        model=MODEL,
        input="add a file",
        tools=TOOLS,
        tool_choice={"type": "custom", "name": "apply_patch"},
    )
    assert response.tool_choice.type == "custom"
    assert [item.type for item in response.output] == ["custom_tool_call"]
    call = response.output[0]
    assert call.name == "apply_patch" and call.input == PATCH
    assert call.id.startswith("ctc_") and call.call_id.startswith("call_")

    events = _events(
        scripted_server.client.responses.create(
            model=MODEL, input="add a file", tools=TOOLS, stream=True
        )
    )
    assert _types(events) == ["response.created", "response.in_progress"] + CUSTOM_ITEM + [
        "response.completed"
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    input_done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    item_done = next(e for e in events if e.type == "response.output_item.done").item
    assert deltas == input_done.input == item_done.input == PATCH
    assert item_done.type == "custom_tool_call" and item_done.name == "apply_patch"


def test_namespace_tool_call_returns_name_and_namespace(
    scripted_server: LiveServer, script: SwitchableRunner
) -> None:
    script.set_script(NAMESPACE_CALL)
    response = scripted_server.client.responses.create(
        model=MODEL, input="look up resin", tools=TOOLS
    )
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text == "Looking it up."
    call = response.output[1]
    assert (call.name, call.namespace) == ("lookup", "mcp")
    assert json.loads(call.arguments) == {"query": "resin"}

    events = _events(
        scripted_server.client.responses.create(
            model=MODEL, input="look up resin", tools=TOOLS, stream=True
        )
    )
    assert _types(events) == [
        "response.created",
        "response.in_progress",
    ] + MESSAGE_ITEM + FUNCTION_ITEM + ["response.completed"]
    item_done = [e.item for e in events if e.type == "response.output_item.done"][1]
    assert (item_done.name, item_done.namespace) == ("lookup", "mcp")


def test_reasoning_and_message(scripted_server: LiveServer, script: SwitchableRunner) -> None:
    script.set_script(ANSWER)
    response = scripted_server.client.responses.create(model=MODEL, input="hi")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text.strip() == "the user says hi"
    assert response.output_text == "Hello there!"
    with_tools_off = scripted_server.client.responses.create(
        model=MODEL, input="hi", tools=TOOLS, tool_choice="none"
    )
    assert with_tools_off.output_text == "Hello there!"


def test_max_output_tokens_gives_incomplete(
    scripted_server: LiveServer, script: SwitchableRunner
) -> None:
    response = scripted_server.client.responses.create(
        model=MODEL, input="list the files", tools=TOOLS, max_output_tokens=9
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.output[0].status == "incomplete"
    assert response.usage.output_tokens == 9

    events = _events(
        scripted_server.client.responses.create(
            model=MODEL, input="list the files", tools=TOOLS, max_output_tokens=9, stream=True
        )
    )
    assert _types(events) == ["response.created", "response.in_progress"] + REASONING_ITEM + [
        "response.incomplete"
    ]
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage.output_tokens == 9 and final.output[0].status == "incomplete"


def test_context_exhaustion_fails_with_context_length_exceeded(
    scripted_server: LiveServer, script: SwitchableRunner
) -> None:
    body = {"model": MODEL, "input": "x " * 3900, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{scripted_server.url}/v1/responses", json=body, timeout=60
    ) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    final = json.loads(lines[-1][len("data: ") :])
    assert final["type"] == "response.failed"
    response = final["response"]
    assert response["status"] == "failed"
    assert response["error"]["code"] == "context_length_exceeded"
    usage = response["usage"]
    assert usage["input_tokens"] + usage["output_tokens"] == scripted_server.ctx.max_model_len


def test_runner_failure_mid_stream_is_response_failed(
    scripted_server: LiveServer, script: SwitchableRunner
) -> None:
    script.fail = True
    events = _events(scripted_server.client.responses.create(model=MODEL, input="hi", stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.failed"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert "injected runner failure" in failed.error.message
    script.fail = False
    assert scripted_server.client.responses.create(model=MODEL, input="hi").status == "completed"


def test_client_disconnect_aborts_generation(
    scripted_server: LiveServer, script: SwitchableRunner
) -> None:
    loop = scripted_server.ctx.loop
    script.delay_s = 0.005  # 8000 tokens would take 40 s: only an abort ends it in time
    body = {
        "model": MODEL,
        "input": "go on forever",
        "stream": True,
        "ignore_eos": True,
        "max_output_tokens": 8000,
    }
    tokens_before = _metric(scripted_server, "resin:generation_tokens_total")
    with httpx.stream(
        "POST", f"{scripted_server.url}/v1/responses", json=body, timeout=60
    ) as reply:
        for line in reply.iter_lines():
            if "response.reasoning_text.delta" in line:
                break
    deadline = time.monotonic() + 3
    while loop.num_active_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.num_active_requests == 0
    assert not loop.engine.has_unfinished() or _settles(loop)
    # stopped long before max_output_tokens (at 5 ms per token, 3 s is at most ~600 tokens)
    assert _metric(scripted_server, "resin:generation_tokens_total") - tokens_before < 1000


def _metric(server: LiveServer, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _settles(loop: Any) -> bool:
    deadline = time.monotonic() + 3
    while loop.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not loop.engine.has_unfinished()


# -- a Codex-shaped request -----------------------------------------------------------------------

CODEX_BODY: dict[str, Any] = {
    "model": MODEL,
    "instructions": "You are Codex, a coding agent.",
    "input": [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "list the files"}],
        },
        {
            "type": "reasoning",
            "id": "rs_0",
            "summary": [{"type": "summary_text", "text": "should run ls"}],
            "content": None,
            "encrypted_content": None,
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Running ls."}],
        },
        {
            "type": "function_call",
            "id": "fc_0",
            "call_id": "call_a",
            "name": "shell",
            "arguments": '{"command": ["ls"]}',
        },
        {
            "type": "function_call",
            "call_id": "call_b",
            "name": "lookup",
            "namespace": "mcp",
            "arguments": '{"query": "x"}',
        },
        {"type": "function_call_output", "call_id": "call_a", "output": "README.md"},
        {
            "type": "function_call_output",
            "call_id": "call_b",
            "output": [{"type": "input_text", "text": "found x"}],
        },
        {"type": "custom_tool_call", "call_id": "call_c", "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "call_id": "call_c", "output": "Done!"},
        {
            "type": "local_shell_call",
            "call_id": "call_d",
            "status": "completed",
            "action": {"type": "exec", "command": ["pwd"]},
        },
        {"type": "web_search_call", "id": "ws_0", "status": "completed"},
        {"type": "item_reference", "id": "msg_old"},
        {"type": "compaction", "encrypted_content": "opaque"},
        {
            "type": "message",
            "role": "developer",
            "content": [
                {"type": "input_text", "text": "<environment_context>cwd=/w</environment_context>"}
            ],
        },
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "now add a file"}],
        },
    ],
    "tools": TOOLS,
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "conv-1",
    "text": {
        "verbosity": "low",
        "format": {
            "type": "json_schema",
            "name": "codex_output_schema",
            "strict": True,
            "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}},
        },
    },
    "client_metadata": {"x": "y"},
    "service_tier": "auto",
}


def test_codex_shaped_request_streams(
    scripted_server: LiveServer, script: SwitchableRunner
) -> None:
    script.set_script(PATCH_CALL)
    events = _events(
        scripted_server.client.responses.create(
            **{k: v for k, v in CODEX_BODY.items() if k not in ("client_metadata",)},
            extra_body={"client_metadata": CODEX_BODY["client_metadata"]},
        )
    )
    assert events[-1].type == "response.completed"
    final = events[-1].response
    assert [item.type for item in final.output] == ["custom_tool_call"]
    assert final.output[0].input == PATCH
    assert final.store is False and final.parallel_tool_calls is False
    assert final.text.format.type == "json_schema"  # accepted and echoed, not enforced
    assert final.reasoning.effort == "medium" and final.prompt_cache_key == "conv-1"
    assert final.usage.input_tokens > 0


def test_codex_shaped_request_renders(scripted_server: LiveServer) -> None:
    request = prepare_response(scripted_server.ctx, json.loads(json.dumps(CODEX_BODY)))
    text = request.prompt.text
    assert text.startswith("<|im_start|>system\nYou are Codex, a coding agent.\n\n# Tools")
    tools = [
        json.loads(line) for line in text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    ]
    assert [t["function"]["name"] for t in tools] == ["shell", "apply_patch", "mcp__lookup"]
    assert tools[1]["function"]["parameters"]["required"] == ["input"]
    assert text.count("<|im_start|>system") == 1  # the late developer item is a reminder
    assert "<|im_start|>user\nnow add a file\n\n<system-reminder>" not in text
    assert (
        "<system-reminder>\n<environment_context>cwd=/w</environment_context>\n"
        "</system-reminder>" in text
    )
    assert (
        '<|im_start|>assistant\nRunning ls.\n<tool_call>\n{"name": "shell", "arguments": '
        '{"command": ["ls"]}}\n</tool_call>\n<tool_call>\n{"name": "mcp__lookup"'
    ) in text
    assert ('{"name": "apply_patch", "arguments": {"input": ' + json.dumps(PATCH)) in text
    assert "<tool_response>\nREADME.md\n</tool_response>\n<tool_response>\nfound x\n" in text
    assert "<tool_response>\nDone!\n</tool_response>" in text
    assert "pwd" not in text and "msg_old" not in text and "opaque" not in text
    assert request.targets["apply_patch"].kind == "custom"
    assert (request.targets["mcp__lookup"].name, request.targets["mcp__lookup"].namespace) == (
        "lookup",
        "mcp",
    )
    assert text.endswith("<|im_start|>assistant\n")
    off = prepare_response(scripted_server.ctx, {**CODEX_BODY, "reasoning": {"effort": "none"}})
    assert off.prompt.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_reasoning_items_become_reasoning_content(scripted_server: LiveServer) -> None:
    body = {
        "model": MODEL,
        "input": [
            {"role": "user", "content": "hi"},
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "greet back"}],
            },
            {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "tools": [SHELL_TOOL],
    }
    text = prepare_response(scripted_server.ctx, body).prompt.text
    assert "<|im_start|>assistant\n<think>\ngreet back\n</think>\n\n<tool_call>" in text


# -- malformed requests ---------------------------------------------------------------------------

MALFORMED = [
    ("input is a number", {"model": MODEL, "input": 42}, 400, "input", None),
    ("input missing", {"model": MODEL}, 400, "input", None),
    ("item is a string", {"model": MODEL, "input": ["hi"]}, 400, "input", None),
    (
        "unknown role",
        {"model": MODEL, "input": [{"role": "wizard", "content": "hi"}]},
        400,
        "input",
        None,
    ),
    (
        "content is a number",
        {"model": MODEL, "input": [{"role": "user", "content": 7}]},
        400,
        "input",
        None,
    ),
    (
        "function_call without call_id",
        {"model": MODEL, "input": [{"type": "function_call", "name": "shell"}]},
        400,
        "input",
        None,
    ),
    (
        "image input",
        {
            "model": MODEL,
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}],
                }
            ],
        },
        400,
        "input",
        None,
    ),
    (
        "previous_response_id",
        {"model": MODEL, "input": "hi", "previous_response_id": "resp_1"},
        400,
        "previous_response_id",
        None,
    ),
    (
        "tools not a list",
        {"model": MODEL, "input": "hi", "tools": {"type": "function"}},
        400,
        "tools",
        None,
    ),
    (
        "tool_choice names a missing tool",
        {
            "model": MODEL,
            "input": "hi",
            "tools": [SHELL_TOOL],
            "tool_choice": {"type": "function", "name": "nope"},
        },
        400,
        "tool_choice",
        None,
    ),
    (
        "tool_choice names a function as custom",
        {
            "model": MODEL,
            "input": "hi",
            "tools": [SHELL_TOOL],
            "tool_choice": {"type": "custom", "name": "shell"},
        },
        400,
        "tool_choice",
        None,
    ),
    (
        "tool_choice is a bad string",
        {"model": MODEL, "input": "hi", "tool_choice": "always"},
        400,
        "tool_choice",
        None,
    ),
    (
        "temperature out of range",
        {"model": MODEL, "input": "hi", "temperature": 5},
        400,
        "temperature",
        None,
    ),
    (
        "max_output_tokens over the context",
        {"model": MODEL, "input": "hi", "max_output_tokens": 100000},
        400,
        "input",
        "context_length_exceeded",
    ),
    ("unknown model", {"model": "gpt-nope", "input": "hi"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("name,body,status,param,code", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_requests(
    torch_server: LiveServer,
    name: str,
    body: dict[str, Any],
    status: int,
    param: str,
    code: str | None,
) -> None:
    for stream in (False, True):
        reply = httpx.post(
            f"{torch_server.url}/v1/responses", json={**body, "stream": stream}, timeout=30
        )
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param and error["code"] == code and error["message"]
        assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if name == "previous_response_id":
        assert error["message"] == (
            "previous_response_id is not supported (the server is stateless; send the full input)"
        )


def test_invalid_json_and_sdk_errors(torch_server: LiveServer) -> None:
    reply = httpx.post(
        f"{torch_server.url}/v1/responses",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as bad:
        torch_server.client.responses.create(model=MODEL, input="hi", previous_response_id="resp_x")
    assert bad.value.status_code == 400 and "stateless" in bad.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        torch_server.client.responses.create(model="gpt-nope", input="hi")
    assert missing.value.code == "model_not_found"
    response = torch_server.client.responses.create(
        model=MODEL, input="still there?", max_output_tokens=3, tools=[], tool_choice="auto"
    )
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens > 0
    assert torch_server.ctx.loop.num_active_requests == 0
