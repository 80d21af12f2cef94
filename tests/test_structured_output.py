"""Structured outputs, enforced: JSON schemas, JSON objects and forced tool calls, on every API.

The random-weight Qwen3 fixture writes noise when unconstrained, so every assertion here (valid
JSON matching the schema, a well-formed call with schema-valid arguments) holds only because
the sampler masks the logits with the request's grammar (:mod:`resin.structured_output`).
Also: the sampler's grammar state across a discarded plan and a preempted request, and the 400
for a schema that cannot be compiled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("xgrammar")

from resin.server.context import ServerOptions  # noqa: E402
from resin.server.serve import build_context  # noqa: E402
from resin.server.structured import parse_format  # noqa: E402
from tests.server_harness import LiveServer  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3"
MODEL = "qwen3-tiny"
MESSAGES = [{"role": "user", "content": "Give me the data."}]

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["colour", "ok", "count"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def check(value: Any, schema: dict[str, Any]) -> None:
    """A small validator for the schemas above (object / enum / boolean / bounded integer)."""
    if "enum" in schema:
        assert value in schema["enum"], value
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict), value
        assert set(value) == set(schema["required"]), value
        for key, item in value.items():
            check(item, schema["properties"][key])
    elif kind == "boolean":
        assert isinstance(value, bool), value
    elif kind == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), value
        assert schema["minimum"] <= value <= schema["maximum"], value


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    ctx = build_context(
        FIXTURE,
        runner="torch",
        options=ServerOptions(served_model_names=[MODEL]),
        max_num_seqs=8,
        max_model_len=1024,
    )
    assert ctx.structured is not None
    with LiveServer(ctx) as live:
        yield live


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def sse_data(response: httpx.Response) -> list[dict[str, Any]]:
    return [
        json.loads(line[6:])
        for line in response.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def chat(server: LiveServer, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, **fields}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "data", "schema": SCHEMA, "strict": True},
}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema(server: LiveServer, temperature: float) -> None:
    result = chat(server, response_format=RESPONSE_FORMAT, temperature=temperature, n=2, seed=3)
    for choice in result["choices"]:
        assert choice["finish_reason"] == "stop"
        check(json.loads(choice["message"]["content"]), SCHEMA)


def test_chat_json_schema_stream(server: LiveServer) -> None:
    response = post(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 300,
            "stream": True,
            "temperature": 0.8,
            "seed": 11,
            "response_format": RESPONSE_FORMAT,
        },
    )
    assert response.status_code == 200
    chunks = sse_data(response)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    check(json.loads(text), SCHEMA)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_json_object(server: LiveServer) -> None:
    result = chat(
        server, response_format={"type": "json_object"}, temperature=0.7, seed=5, max_tokens=600
    )
    choice = result["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # a random model may write a long object: what it wrote is still an object's start
        assert choice["message"]["content"].startswith("{")


def test_unconstrained_output_is_not_json(server: LiveServer) -> None:
    """The control: without the grammar the fixture does not write this schema's JSON."""
    content = chat(server, temperature=0)["choices"][0]["message"]["content"]
    with pytest.raises((ValueError, AssertionError, KeyError, TypeError)):
        check(json.loads(content), SCHEMA)


def test_chat_tool_choice_required(server: LiveServer) -> None:
    result = chat(server, tools=CHAT_TOOLS, tool_choice="required", temperature=1.0, seed=1, n=3)
    for choice in result["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        name = call["function"]["name"]
        check(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_allowed_tools_required_calls_one_of_them(server: LiveServer) -> None:
    """allowed_tools with mode required forces a call of an allowed tool only (the prompt still
    lists both); mode auto forces nothing; a name not in tools is a 400. Chat nests the list,
    Responses does not."""
    only_time = [{"type": "function", "function": {"name": "get_time"}}]
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": only_time}}
    result = chat(server, tools=CHAT_TOOLS, tool_choice=allowed, temperature=1.0, seed=3, n=4)
    for choice in result["choices"]:
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time"
        check(json.loads(call["function"]["arguments"]), TIME)
    tools = [
        {"type": "function", "name": "get_weather", "parameters": WEATHER},
        {"type": "function", "name": "get_time", "parameters": TIME},
    ]
    body = {"model": MODEL, "input": "weather?", "max_output_tokens": 300, "tools": tools}
    flat = {
        "type": "allowed_tools",
        "mode": "required",
        "tools": [{"type": "function", "name": "get_weather"}],
    }
    response = post(server, "/v1/responses", {**body, "tool_choice": flat, "temperature": 0.9})
    [call] = [item for item in response.json()["output"] if item["type"] == "function_call"]
    assert call["name"] == "get_weather"
    unknown = {**flat, "tools": [{"type": "function", "name": "get_news"}]}
    refused = post(server, "/v1/responses", {**body, "tool_choice": unknown})
    assert refused.status_code == 400 and "get_news" in refused.text
    auto = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": only_time}}
    free = chat(server, tools=CHAT_TOOLS, tool_choice=auto, temperature=0, max_tokens=5)
    assert free["choices"][0]["finish_reason"] == "length"  # not forced: the fixture rambles


def test_chat_tool_choice_named(server: LiveServer) -> None:
    result = chat(
        server,
        tools=CHAT_TOOLS,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    choice = result["choices"][0]
    assert choice["finish_reason"] == "stop"  # OpenAI's (and vLLM's) for a call forced by name
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    check(json.loads(call["function"]["arguments"]), TIME)


def test_chat_tool_choice_named_stream(server: LiveServer) -> None:
    response = post(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 300,
            "stream": True,
            "tools": CHAT_TOOLS,
            "temperature": 0.9,
            "seed": 2,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    )
    chunks = [c for c in sse_data(response) if c["choices"]]
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather"
    arguments = "".join(tc["function"].get("arguments") or "" for tc in calls)
    check(json.loads(arguments), WEATHER)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"  # named: as OpenAI


def test_responses_text_format_json_schema(server: LiveServer) -> None:
    for stream in (False, True):
        response = post(
            server,
            "/v1/responses",
            {
                "model": MODEL,
                "input": "Give me the data.",
                "max_output_tokens": 300,
                "temperature": 0.8,
                "stream": stream,
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "data",
                        "schema": SCHEMA,
                        "strict": True,
                    }
                },
            },
        )
        assert response.status_code == 200, response.text
        if stream:
            final = [e for e in sse_data(response) if e["type"] == "response.completed"]
            body = final[0]["response"]
        else:
            body = response.json()
        [message] = [item for item in body["output"] if item["type"] == "message"]
        check(json.loads(message["content"][0]["text"]), SCHEMA)
        assert body["text"]["format"]["type"] == "json_schema"


def test_responses_tool_choice(server: LiveServer) -> None:
    tools = [
        {"type": "function", "name": "get_weather", "parameters": WEATHER},
        {"type": "function", "name": "get_time", "parameters": TIME},
    ]
    for choice, expected in (
        ("required", None),
        ({"type": "function", "name": "get_weather"}, "get_weather"),
    ):
        response = post(
            server,
            "/v1/responses",
            {
                "model": MODEL,
                "input": "weather?",
                "max_output_tokens": 300,
                "tools": tools,
                "tool_choice": choice,
                "temperature": 0.9,
            },
        )
        assert response.status_code == 200, response.text
        [call] = [item for item in response.json()["output"] if item["type"] == "function_call"]
        assert expected is None or call["name"] == expected
        check(json.loads(call["arguments"]), SCHEMAS[call["name"]])


ANTHROPIC_TOOLS = [
    {"name": "get_weather", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": TIME},
]


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}])
def test_anthropic_tool_choice(server: LiveServer, tool_choice: dict[str, Any]) -> None:
    response = post(
        server,
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 300,
            "messages": MESSAGES,
            "tools": ANTHROPIC_TOOLS,
            "tool_choice": tool_choice,
            "temperature": 1.0,
        },
    )
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["stop_reason"] == "tool_use"
    [block] = [b for b in message["content"] if b["type"] == "tool_use"]
    assert tool_choice["type"] == "any" or block["name"] == "get_time"
    check(block["input"], SCHEMAS[block["name"]])


def test_anthropic_tool_choice_stream(server: LiveServer) -> None:
    response = post(
        server,
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 300,
            "messages": MESSAGES,
            "tools": ANTHROPIC_TOOLS,
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "stream": True,
        },
    )
    events = sse_data(response)
    partial = "".join(
        e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta"
    )
    check(json.loads(partial), WEATHER)
    [stop] = [e for e in events if e["type"] == "message_delta"]
    assert stop["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            "/v1/chat/completions",
            {
                "tools": [
                    CHAT_TOOLS[0],
                    {
                        "type": "function",
                        "function": {
                            "name": "bad",
                            "parameters": {"type": "object", "properties": {"a": {"$ref": "#/x"}}},
                        },
                    },
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            "/v1/responses",
            {
                "text": {
                    "format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}
                }
            },
            "text.format.schema",
        ),
    ],
)
def test_bad_schema_is_400(server: LiveServer, path: str, body: dict[str, Any], param: str) -> None:
    full = {"model": MODEL, "max_tokens": 10, **body}
    full["input" if path == "/v1/responses" else "messages"] = (
        "hi" if path == "/v1/responses" else MESSAGES
    )
    if path == "/v1/responses":
        full.pop("max_tokens")
    response = post(server, path, full)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error


def test_anthropic_bad_tool_schema_is_400(server: LiveServer) -> None:
    response = post(
        server,
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 10,
            "messages": MESSAGES,
            "tools": [
                {
                    "name": "bad",
                    "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}},
                }
            ],
            "tool_choice": {"type": "any"},
        },
    )
    assert response.status_code == 400, response.text
    assert "tools[0].input_schema" in response.text


def test_grammar_entries_are_released(server: LiveServer) -> None:
    chat(server, response_format={"type": "json_object"}, max_tokens=5)
    assert not server.ctx.structured.registry.active


def test_a_grammar_the_engine_cannot_follow_fails_the_request(server: LiveServer) -> None:
    """A schema with more alternatives at one point than llguidance's parser takes (2,000 a
    row) compiles, but the grammar refuses the first token: the request is a 400 saying so
    (streamed: an in-stream error), never output the schema does not allow."""
    if server.ctx.structured.compiler.engine != "llguidance":
        pytest.skip("the 2,000-item parser row is llguidance's limit")
    alternatives = [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        for i in range(2100)
    ]
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "many", "schema": {"anyOf": alternatives}},
    }
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20}
    response = post(server, "/v1/chat/completions", {**body, "response_format": response_format})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "structured output could not be enforced" in error["message"]
    assert "max is 2000" in error["message"]
    streamed = post(
        server,
        "/v1/chat/completions",
        {**body, "response_format": response_format, "stream": True},
    )
    events = sse_data(streamed)
    assert "structured output could not be enforced" in events[-1]["error"]["message"]
    assert not server.ctx.structured.registry.active  # released, and the server goes on
    chat(server, response_format=RESPONSE_FORMAT)


def test_compiled_grammars_are_reused_for_the_same_schema(server: LiveServer) -> None:
    """Agents send the same tools every turn: the second request reuses the first one's
    grammar (compiling a few hundred tools takes ~1 s), a changed schema compiles anew."""
    structured = server.ctx.structured
    structured._cache.clear()
    first = structured.tool_grammar(CHAT_TOOLS, "required", ["tools[0]", "tools[1]"])
    again = structured.tool_grammar(CHAT_TOOLS, "required", ["tools[0]", "tools[1]"])
    assert again is first
    named = structured.tool_grammar(
        CHAT_TOOLS, {"type": "function", "name": "get_time"}, ["tools[0]", "tools[1]"]
    )
    other = structured.format_grammar(parse_format(RESPONSE_FORMAT, "response_format", nested=True))
    assert named is not first and other is not first and len(structured._cache) == 3
    forced = {"type": "function", "function": {"name": "get_weather"}}
    for _ in range(2):  # through the server: one more entry, then a hit
        chat(server, tools=CHAT_TOOLS, tool_choice=forced, max_tokens=60)
    assert len(structured._cache) == 4


# -- the sampler's grammar state: failed plans and preemption replay exactly ---------------

VOCAB = [
    "<eos>",
    "{",
    "}",
    '"',
    ":",
    ",",
    " ",
    "a",
    "b",
    "true",
    "false",
    "x",
    "y",
    *"0123456789",
    "[",
    "]",
    "n",
    "u",
    "l",
    "t",
    "r",
    "e",
    "s",
    "f",
]
TINY_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


class GrammarRunner:
    """Logits = a fixed random table[last token]; every request follows TINY_SCHEMA; fails
    (after begin_step) on the calls in ``fail_calls``."""

    def __init__(self, grammar: Any, fail_calls: frozenset[int] = frozenset()) -> None:
        import numpy as np
        import torch

        from resin.sampling import Sampler

        self.sampler = Sampler(len(VOCAB))
        self.grammar = grammar
        table = np.random.default_rng(2).normal(0.0, 3.0, (len(VOCAB), len(VOCAB)))
        self.table = torch.from_numpy(table.astype(np.float32))
        self.fail_calls, self.calls = fail_calls, 0

    def forward(self, plan: Any) -> Any:
        import numpy as np
        import torch

        self.calls += 1
        for request_id in plan.request_ids:
            self.sampler.grammars.register(request_id, self.grammar)
        self.sampler.begin_step(plan)
        if self.calls in self.fail_calls:
            raise RuntimeError("fails after begin_step")
        rows = np.flatnonzero(np.diff(plan.sample_indptr) == 1)
        last = plan.input_ids[plan.query_indptr[rows + 1] - 1].astype(np.int64)
        return self.sampler.sample(self.table[torch.from_numpy(last)], plan, rows)


def run_engine(runner: GrammarRunner, **config: Any) -> dict[str, list[int]]:
    import resin

    engine = resin.Engine(
        resin.EngineConfig(
            **{"page_size": 4, "num_pages": 64, "max_model_len": 64, "eos_token_ids": [0], **config}
        ),
        runner,
    )
    prompts = {
        "a": [1, 2, 3, 4, 5, 6, 7, 8, 9],
        "b": [1, 2, 3, 4, 5, 6, 7, 8, 20, 21],
        "c": [3, 3, 3],
    }
    params = [
        resin.SamplingParams(max_tokens=28, temperature=0.0),
        resin.SamplingParams(max_tokens=28, temperature=1.0, seed=7),
    ]
    for copy in range(2):
        for name, prompt in prompts.items():
            engine.add_request(f"{name}{copy}", prompt, params[copy])
    finished: dict[str, list[int]] = {}
    for _ in range(800):
        if not engine.has_unfinished():
            break
        try:
            outputs = engine.step()
        except resin.StepError:
            continue
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out.token_ids
    return finished


@pytest.mark.parametrize(
    "config",
    [{}, {"page_size": 1, "num_pages": 48, "max_model_len": 40, "max_num_batched_tokens": 5}],
    ids=["plain", "chunked_preempted"],
)
def test_sampler_grammar_survives_failed_plans_and_preemption(config: dict[str, Any]) -> None:
    import xgrammar as xgr

    from resin.structured_output import GrammarCompiler

    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[0])
    grammar = GrammarCompiler.from_info(info).json_schema(TINY_SCHEMA, "schema")
    expected = run_engine(GrammarRunner(grammar), **config)
    assert len(expected) == 6
    for tokens in expected.values():
        assert tokens[-1] == 0, tokens
        check(json.loads("".join(VOCAB[t] for t in tokens[:-1])), TINY_SCHEMA)
    flaky = GrammarRunner(grammar, fail_calls=frozenset({2, 3, 5, 8, 13, 21}))
    assert run_engine(flaky, **config) == expected


def _sample_under_mask(slot: Any, seed: int, vocab_size: int = 384) -> list[int]:
    """Tokens drawn from random logits under ``slot``'s grammar mask until it terminates (at
    most 400)."""
    import torch
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    while not slot.matcher.is_terminated() and len(tokens) < 400:
        slot.matcher.fill_next_token_bitmask(bitmask, 0)
        logits = torch.randn(1, vocab_size, generator=generator) * 3
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        tokens.append(token)
        slot.sync(tokens)
    return tokens


@pytest.mark.parametrize("tool_parser", ["hermes", "llama3_json", "deepseek_v3", "deepseek_v31"])
def test_forced_call_formats_parse_back(tool_parser: str) -> None:
    """Every call format a forced call can take is read back by its own tool parser as one
    schema-valid call (random logits under the mask, several seeds, required and named)."""

    from resin.server.parsers import OutputParser
    from resin.structured_output import GrammarCompiler, GrammarSlot
    from resin.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(FIXTURE)
    compiler = GrammarCompiler(tokenizer, 384, tokenizer.eos_token_ids, tool_parser)
    assert compiler.supports_tool_calls
    for seed in range(4):
        name = None if seed % 2 else "get_weather"
        slot = GrammarSlot(compiler.tool_call(CHAT_TOOLS, name, ["a", "b"]))
        tokens = _sample_under_mask(slot, seed)
        assert slot.matcher.is_terminated() and tokens[-1] in tokenizer.eos_token_ids
        parser = OutputParser(tool_parser, None, tools=CHAT_TOOLS)
        parser.feed(tokenizer.decode(tokens[:-1]))
        parser.finish()
        [call] = parser.tool_calls
        assert name is None or call.name == name
        check(json.loads(call.arguments), SCHEMAS[call.name])
        assert not parser.content_text.strip()


def test_xml_call_formats_are_not_forced() -> None:
    from resin.structured_output import GrammarCompiler
    from resin.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(FIXTURE)
    for parser in ("qwen3_coder", "glm45", None):
        assert not GrammarCompiler(tokenizer, 384, [1], parser).supports_tool_calls


def test_output_after_an_opened_think_closes_it_first() -> None:
    """A prompt that opened ``<think>`` (or the deepseek_r1 parser) would make the JSON
    reasoning: the grammar writes ``</think>\\n\\n`` first, so it is the content."""
    from types import SimpleNamespace

    import torch
    import xgrammar as xgr

    from resin.server.parsers import OutputParser
    from resin.server.structured import reasoning_prefix
    from resin.structured_output import GrammarCompiler, GrammarSlot
    from resin.tokenizer import Tokenizer

    ctx = SimpleNamespace(options=SimpleNamespace(reasoning_parser="qwen3"))
    opened = SimpleNamespace(reasoning_started=True, reasoning_closed=False)
    plain = SimpleNamespace(reasoning_started=False, reasoning_closed=False)
    closed = SimpleNamespace(reasoning_started=False, reasoning_closed=True)
    assert reasoning_prefix(ctx, opened) == "</think>\n\n"
    assert reasoning_prefix(ctx, plain) == reasoning_prefix(ctx, closed) == ""
    r1 = SimpleNamespace(options=SimpleNamespace(reasoning_parser="deepseek_r1"))
    assert reasoning_prefix(r1, plain) == "</think>\n\n" and reasoning_prefix(r1, closed) == ""

    tokenizer = Tokenizer.from_pretrained(FIXTURE)
    compiler = GrammarCompiler(tokenizer, 384, tokenizer.eos_token_ids, "hermes")
    bitmask = xgr.allocate_token_bitmask(1, 384)
    generator = torch.Generator().manual_seed(0)
    for grammar in (
        compiler.json_schema(SCHEMA, "s", prefix="</think>\n\n"),
        compiler.tool_call(CHAT_TOOLS, None, [], prefix="</think>\n\n"),
    ):
        slot = GrammarSlot(grammar)
        tokens: list[int] = []
        while not slot.matcher.is_terminated() and len(tokens) < 400:
            slot.matcher.fill_next_token_bitmask(bitmask, 0)
            logits = torch.randn(1, 384, generator=generator) * 3
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            tokens.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
            slot.sync(tokens)
        parser = OutputParser("hermes", "qwen3", tools=CHAT_TOOLS, reasoning_started=True)
        parser.feed(tokenizer.decode(tokens[:-1]))
        parser.finish()
        assert parser.reasoning_text == ""
        if grammar.description == "json_schema":
            check(json.loads(parser.content_text), SCHEMA)
        else:
            [call] = parser.tool_calls
            check(json.loads(call.arguments), SCHEMAS[call.name])


def test_grammar_overrides_min_tokens_and_ignore_eos(server: LiveServer) -> None:
    for extra in ({"min_tokens": 60}, {"ignore_eos": True}):
        result = chat(
            server, response_format=RESPONSE_FORMAT, temperature=1.0, max_tokens=80, **extra
        )
        choice = result["choices"][0]
        assert choice["finish_reason"] == "stop", extra
        check(json.loads(choice["message"]["content"]), SCHEMA)


def test_sampler_grammar_wins_over_bans() -> None:
    """min_tokens bans the stop token where the grammar allows nothing else: the row samples
    under the grammar mask alone (no NaN from an all -inf row), so the JSON is complete."""
    import xgrammar as xgr

    import resin
    from resin.structured_output import GrammarCompiler

    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[0])
    runner = GrammarRunner(GrammarCompiler.from_info(info).json_schema(TINY_SCHEMA, "schema"))
    engine = resin.Engine(
        resin.EngineConfig(page_size=4, num_pages=64, max_model_len=64, eos_token_ids=[0]), runner
    )
    engine.add_request("r", [1, 2, 3], resin.SamplingParams(max_tokens=40, min_tokens=35))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens = out.token_ids
    end = tokens.index(0)
    check(json.loads("".join(VOCAB[t] for t in tokens[:end])), TINY_SCHEMA)


DEFS_SCHEMA = {
    "type": "object",
    "$defs": {"Mode": {"type": "string", "enum": ["fast", "slow"]}},
    "definitions": {"Digit": {"type": "integer", "minimum": 0, "maximum": 9}},
    "properties": {"mode": {"$ref": "#/$defs/Mode"}, "n": {"$ref": "#/definitions/Digit"}},
    "required": ["mode", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("engine", ["llguidance", "xgrammar"])
def test_a_forced_call_resolves_the_tools_own_definitions(engine: str) -> None:
    """A tool whose parameters use ``$defs`` / ``definitions`` (pydantic's and MCP's schemas
    do): nesting them under the call's ``arguments`` moved their root, and the forced call
    failed to compile ("Pointer '/$defs/Mode' does not exist"). Every sampled call is now
    schema-valid; a recursive one (``$ref: "#"``) compiles too."""

    from resin.server.parsers import OutputParser
    from resin.structured_output import GrammarCompiler, GrammarSlot, _nested_schema
    from resin.tokenizer import Tokenizer

    tools = [{"type": "function", "function": {"name": "pick", "parameters": DEFS_SCHEMA}}]
    tools += CHAT_TOOLS
    tokenizer = Tokenizer.from_pretrained(FIXTURE)
    compiler = GrammarCompiler(tokenizer, 384, tokenizer.eos_token_ids, "hermes", engine=engine)
    for seed in range(3):
        slot = GrammarSlot(compiler.tool_call(tools, "pick", ["a", "b", "c"]))
        tokens = _sample_under_mask(slot, seed)
        parser = OutputParser("hermes", None, tools=tools)
        parser.feed(tokenizer.decode(tokens[:-1]))
        parser.finish()
        [call] = parser.tool_calls
        assert call.name == "pick"
        arguments = json.loads(call.arguments)
        assert set(arguments) == {"mode", "n"} and arguments["mode"] in ("fast", "slow")
        assert arguments["n"] in range(10), arguments
    tree = {
        "type": "object",
        "properties": {"child": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
        "required": ["child"],
    }
    recursive = [{"type": "function", "function": {"name": "tree", "parameters": tree}}]
    compiler.tool_call(recursive, None, ["a"])
    body, definitions = _nested_schema(tree, "tool0")
    assert body["properties"]["child"]["anyOf"][1] == {"$ref": "#/$defs/tool0__root"}
    assert definitions == {"tool0__root": body}
    body, definitions = _nested_schema(DEFS_SCHEMA, "tool3")
    assert body["properties"]["mode"] == {"$ref": "#/$defs/tool3_Mode"}
    assert set(definitions) == {"tool3_Mode", "tool3_definitions_Digit"} and "$defs" not in body
    assert body["properties"]["n"] == {"$ref": "#/$defs/tool3_definitions_Digit"}
    data = {"type": "object", "properties": {"a": {"const": {"$ref": "#/$defs/x"}}}}
    assert _nested_schema(data, "tool0") == (data, {})  # a value, not a reference


def test_the_llguidance_path_never_imports_xgrammar() -> None:
    """Importing xgrammar takes seconds, and masks are applied in the engine's step: under
    llguidance the first constrained request used to import it (its bitmask kernel) and stall
    every stream meanwhile. A fresh process compiles, fills and applies a forced call's mask
    without it."""
    import subprocess
    import sys

    script = f"""
import sys, torch
from resin.structured_output import GrammarCompiler, GrammarSlot, allocate_bitmask, apply_bitmask
from resin.tokenizer import Tokenizer
tokenizer = Tokenizer.from_pretrained({str(FIXTURE)!r})
compiler = GrammarCompiler(tokenizer, 384, tokenizer.eos_token_ids, "hermes", engine="llguidance")
tools = [{{"type": "function", "function": {{"name": "f", "parameters": {{"type": "object"}}}}}}]
slot = GrammarSlot(compiler.tool_call(tools, None, ["tools[0]"]))
bitmask = allocate_bitmask(1, 384)
slot.matcher.fill_next_token_bitmask(bitmask, 0)
logits = torch.zeros(1, 384)
apply_bitmask(logits, bitmask, 384)
assert torch.isinf(logits).any() and not torch.isinf(logits).all()
assert "xgrammar" not in sys.modules, "xgrammar was imported"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
