"""gpt-oss harmony output: the ``openai_gptoss`` reasoning parser and the ``openai`` tool parser
(resin/server/parsers/harmony.py), alone and chained, on realistic outputs and malformed ones
(every case through ``check``: the same result for any split into deltas); then the server end
to end on a tiny gpt_oss checkpoint whose tokenizer has the harmony markers as special tokens,
with a scripted runner: OpenAI chat (streamed and not), Responses and Anthropic.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resin.server.parsers import (
    OutputParser,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    default_parsers,
    needs_special_tokens,
)
from resin.server.parsers.harmony import MARKERS, parse_header
from tests.test_server_parsers import WEATHER_TOOLS, check

TOOL, REASONING = "openai", "openai_gptoss"
ANALYSIS = "<|channel|>analysis<|message|>The user wants Oslo's weather for two days.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>"
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
# The recipient after the channel, the content type as <|constrain|>json (harmony's renderer) ...
CALL_AFTER = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Oslo","days":2}'
)
# ... or before it, the content type a plain word (the Hugging Face chat template's layout).
CALL_BEFORE = (
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
    '<|message|>{"city":"Oslo","days":2}'
)
ARGS = '{"city": "Oslo", "days": 2}'


def both(text: str, **kw: Any):  # type: ignore[no-untyped-def]
    return check(text, TOOL, REASONING, tools=WEATHER_TOOLS, **kw)


def no_markers(text: str) -> None:
    assert not any(m in text for m in MARKERS) and "<|" not in text and "|>" not in text


def test_defaults_and_special_tokens() -> None:
    assert default_parsers("gpt_oss") == (TOOL, REASONING)
    assert needs_special_tokens(TOOL, None) and needs_special_tokens(None, REASONING)
    assert not needs_special_tokens(None, None) and not needs_special_tokens("hermes", "qwen3")
    assert OutputParser(TOOL, REASONING).needs_special_tokens
    assert OutputParser(TOOL, REASONING, enable_tools=False).needs_special_tokens
    assert not OutputParser(TOOL, None, enable_tools=False).needs_special_tokens
    assert not OutputParser("hermes", "qwen3").needs_special_tokens


def test_header_parsing() -> None:
    assert parse_header("<|channel|>analysis<|message|>") == ("analysis", None)
    assert parse_header(
        "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>"
    ) == ("commentary", "functions.f")
    assert parse_header(
        "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>"
    ) == (
        "commentary",
        "functions.f",
    )
    assert parse_header("<|start|>assistant<|message|>") == (None, None)
    assert parse_header(" to=functions.f<|channel|>commentary<|message|>") == (
        "commentary",
        "functions.f",
    )


def test_reasoning_then_final_answer() -> None:
    for end in ("<|return|>", ""):  # <|return|> is a stop token: usually not in the text
        r = both(ANALYSIS + FINAL + "It is sunny in Oslo." + end)
        assert r.reasoning == "The user wants Oslo's weather for two days."
        assert (r.content, r.calls) == ("It is sunny in Oslo.", [])


@pytest.mark.parametrize("call", [CALL_AFTER, CALL_BEFORE])
@pytest.mark.parametrize("end", ["<|call|>", ""])
def test_reasoning_then_call(call: str, end: str) -> None:
    r = both(ANALYSIS + call + end)
    assert r.reasoning == "The user wants Oslo's weather for two days."
    assert (r.content, r.calls) == ("", [("get_weather", ARGS)])


def test_preamble_then_call() -> None:
    r = both(ANALYSIS + PREAMBLE + CALL_AFTER)
    assert (r.content, r.calls) == ("Checking the forecast.", [("get_weather", ARGS)])


def test_first_message_may_carry_the_recipient() -> None:
    # The prompt ends with "<|start|>assistant": the header's rest comes first.
    r = both(' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Lima"}')
    assert (r.reasoning, r.content, r.calls) == ("", "", [("get_weather", '{"city": "Lima"}')])


def test_call_ends_where_its_arguments_close() -> None:
    """<|call|> is a stop token, so the text ends right after the arguments: the call must be
    finished before ``finish`` (else the server would report it as cut off)."""
    parser = OutputParser(TOOL, REASONING, tools=WEATHER_TOOLS)
    events = [e for ch in ANALYSIS + CALL_BEFORE for e in parser.feed(ch)]
    assert [type(e) for e in events if isinstance(e, (ToolCallStart, ToolCallEnd))] == [
        ToolCallStart,
        ToolCallEnd,
    ]
    streamed = [e for e in events if isinstance(e, ToolCallArgumentsDelta)]
    assert len(streamed) > 5, "the arguments stream as they arrive"
    assert parser.finish() == []


def test_unterminated_arguments_close_at_finish() -> None:
    parser = OutputParser(TOOL, REASONING, tools=WEATHER_TOOLS)
    events = parser.feed(ANALYSIS + CALL_AFTER[: -len("2}")])
    assert not any(isinstance(e, ToolCallEnd) for e in events)
    (end,) = [e for e in parser.finish() if isinstance(e, ToolCallEnd)]
    assert end.arguments == '{"city": "Oslo"}'  # the valid part: "days" had no value yet


def test_two_calls_and_empty_arguments() -> None:
    r = both(
        CALL_AFTER
        + "<|call|>"
        + "<|start|>assistant to=functions.ping<|channel|>commentary<|message|>"
    )
    assert r.calls == [("get_weather", ARGS), ("ping", "{}")]


def test_tool_parsing_off_drops_calls() -> None:
    """tool_choice "none" (or no tools): the reasoning parser alone; a call is dropped, as vLLM
    does, and no marker reaches the content."""
    r = check(ANALYSIS + PREAMBLE + CALL_AFTER + "<|call|>", None, REASONING)
    assert (r.reasoning, r.content, r.calls) == (
        "The user wants Oslo's weather for two days.",
        "Checking the forecast.",
        [],
    )


def test_tool_parser_alone_reads_analysis_as_content() -> None:
    r = check(ANALYSIS + FINAL + "Sunny.", TOOL, None, tools=WEATHER_TOOLS)
    assert (r.reasoning, r.content) == ("", "The user wants Oslo's weather for two days.Sunny.")


def test_built_in_tool_recipients_are_dropped() -> None:
    r = both(
        "<|channel|>analysis<|message|>Search it.<|end|>"
        '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>'
        "<|start|>assistant<|channel|>commentary to=python<|message|>print(1)<|call|>"
        + FINAL
        + "Found."
    )
    assert (r.reasoning, r.content, r.calls) == ("Search it.", "Found.", [])


def test_malformed_output_falls_back_to_content() -> None:
    # Not harmony at all.
    assert both("Plain text, <| not a marker").content == "Plain text, <| not a marker"
    # A header with a newline before <|message|> was not one: its words are content.
    r = both(ANALYSIS + "<|start|>assistant<|channel|>final\nHello there")
    assert r.content == "assistantfinal\nHello there"
    # Invalid arguments: the call keeps the valid part, the rest of the body is content.
    r = both(ANALYSIS + CALL_AFTER[: -len('"Oslo","days":2}')] + "Oslo}<|call|>")
    assert r.calls == [("get_weather", "{}")] and r.content == "Oslo}"
    # A body that is not a JSON object is content.
    r = both("<|channel|>commentary to=functions.run code<|message|>print(1)<|call|>")
    assert (r.content, r.calls) == ("print(1)", [])
    # Text after the arguments' object is content, not lost.
    r = both(CALL_AFTER + " and more<|call|>")
    assert r.calls == [("get_weather", ARGS)] and r.content == " and more"
    # Missing <|start|>assistant between messages; stray text between messages.
    r = both(ANALYSIS + "<|channel|>final<|message|>Hi<|return|>")
    assert (r.reasoning, r.content) == ("The user wants Oslo's weather for two days.", "Hi")
    r = both(ANALYSIS + "stray<|start|>assistant<|channel|>final<|message|> ok")
    assert r.content == "stray ok"
    # A header the output ends in has no body: dropped (nothing but markers and header words).
    r = both(ANALYSIS + "<|start|>assistant<|channel|>fin")
    assert (r.content, r.calls) == ("", [])
    # A JSON answer a response_format grammar forced from the first token: no header.
    assert both('{"a": 1}').content == '{"a": 1}'
    # Reasoning cut off by max_tokens.
    assert both("<|channel|>analysis<|message|>Let me think").reasoning == "Let me think"
    # A header past HEADER_MAX characters is text.
    r = both("<|channel|>analysis " + "x" * 600 + "<|message|>body")
    assert r.content == "analysis " + "x" * 600 + "body"


@pytest.mark.parametrize("tool, reasoning", [(TOOL, REASONING), (TOOL, None), (None, REASONING)])
def test_random_well_formed_outputs(tool: str | None, reasoning: str | None) -> None:
    """Random turns of analysis, preambles, a final answer or calls parse to what was written,
    for any split; no marker ever reaches the content."""
    rng = random.Random(f"{tool}-{reasoning}")
    words = ["Sure", " thing", ".", "\n", " a < b", " {x}", " é日本", " |", ' "q"', " to=x"]
    for trial in range(40):
        messages: list[tuple[str, str]] = []  # (channel, body) of the messages with text
        calls: list[tuple[str, dict]] = []
        out = ""
        for position in range(rng.randint(1, 4)):
            kind = rng.choice(["analysis", "commentary", "final", "call"])
            start = "" if position == 0 else "<|start|>assistant"
            body = "".join(rng.choice(words) for _ in range(rng.randint(1, 5))).strip()
            if kind == "call":
                args = {"city": body, "days": rng.randint(0, 9)}
                name = f"functions.t{rng.randint(0, 2)}"
                if rng.random() < 0.5:
                    head = f"{start} to={name}<|channel|>commentary json"
                else:
                    head = f"{start}<|channel|>commentary to={name} <|constrain|>json"
                sep = (",", ":") if rng.random() < 0.5 else (", ", ": ")
                out += f"{head}<|message|>{json.dumps(args, separators=sep)}<|call|>"
                calls.append((name.split(".", 1)[1], args))
                continue
            end = rng.choice(["<|end|>", "<|return|>"])
            out += f"{start}<|channel|>{kind}<|message|>{body}{end}"
            messages.append((kind, body))
        out = out.removesuffix("<|call|>").removesuffix("<|return|>")  # stop tokens
        r = check(out, tool, reasoning, seed=trial, splits=6)
        thought = [b for k, b in messages if reasoning and k == "analysis"]
        assert r.reasoning == "".join(thought)
        assert r.content == "".join(b for k, b in messages if not (reasoning and k == "analysis"))
        assert [(name, json.loads(args)) for name, args in r.calls] == (calls if tool else [])
        no_markers(r.content)
        no_markers(r.reasoning)


# --- the server end to end ----------------------------------------------------------------------

MODEL = "gpt-oss-tiny"
HARMONY_SPECIAL = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
]
# A small template in harmony's shape (not OpenAI's): tools in a developer message, earlier
# reasoning from the message's "thinking" (what gpt-oss templates read), calls and results.
TEMPLATE = (
    "<|start|>system<|message|>You are a tiny model.<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n"
    "{%- for t in tools %}\n{{ t.function.name }}: {{ t.function.parameters | tojson }}{%- endfor %}"
    "<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' %}"
    "{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif %}"
    "{%- for tc in m.tool_calls or [] %}<|start|>assistant to=functions.{{ tc.function.name }}"
    "<|channel|>commentary json<|message|>{{ tc.function.arguments | tojson }}<|call|>{%- endfor %}"
    "{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- elif m.role == 'tool' %}<|start|>functions.get_weather to=assistant<|channel|>commentary"
    "<|message|>{{ m.content }}<|end|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
SCRIPT_CALL = (
    "<|channel|>analysis<|message|>Oslo, two days.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Oslo","days":2}<|call|>'
)
SCRIPT_CALL_BEFORE = (  # the recipient before the channel
    "<|channel|>analysis<|message|>Oslo, two days.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
    '<|message|>{"city": "Oslo", "days": 2}<|call|>'
)
SCRIPT_ANSWER = (
    "<|channel|>analysis<|message|>Easy one.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is sunny in Oslo.<|return|>"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("gpt_oss")
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=HARMONY_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["assistant analysis final commentary Oslo weather"] * 10, trainer)
    tok.save(str(root / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in HARMONY_SPECIAL}
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "added_tokens_decoder": {
                    str(i): {"content": t, "special": True} for t, i in ids.items()
                },
                "bos_token": "<|startoftext|>",
                "eos_token": "<|return|>",
                "pad_token": "<|endoftext|>",
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": TEMPLATE,
            }
        )
    )
    tiny = Path(__file__).resolve().parents[1] / "resin" / "models" / "gpt_oss" / "tiny"
    config = json.loads((tiny / "config.json").read_text())
    config.update(vocab_size=tok.get_vocab_size(), bos_token_id=ids["<|startoftext|>"])
    config.update(eos_token_id=ids["<|return|>"], pad_token_id=ids["<|endoftext|>"])
    (root / "config.json").write_text(json.dumps(config))
    stops = [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]]  # as gpt-oss ships
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return root  # no weights: the scripted runner computes nothing


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> Iterator[Any]:
    pytest.importorskip("openai")
    from resin.runners.scripted import ScriptedRunner
    from resin.server.context import ServerOptions
    from resin.server.serve import build_context
    from resin.tokenizer import Tokenizer
    from tests.server_harness import LiveServer

    tokenizer = Tokenizer.from_pretrained(checkpoint)
    special = json.loads((checkpoint / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    special = {v["content"]: int(k) for k, v in special.items()}
    runner = ScriptedRunner([], tokenizer.eos_token_id)
    ctx = build_context(
        checkpoint,
        runner=runner,
        options=ServerOptions(served_model_names=[MODEL]),
        max_num_seqs=2,
        max_model_len=4096,
    )
    assert (ctx.options.tool_parser, ctx.options.reasoning_parser) == (TOOL, REASONING)

    def script(text: str) -> None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.encode("<|channel|>", add_special_tokens=False) == [special["<|channel|>"]]
        runner.script = np.asarray(ids + [tokenizer.eos_token_id], dtype=np.uint32)

    with LiveServer(ctx) as live:
        live.script = script  # type: ignore[attr-defined]
        live.tokenizer = tokenizer  # type: ignore[attr-defined]
        yield live


def test_a_forced_call_is_left_to_the_model(checkpoint: Path) -> None:
    """No grammar writes harmony headers: ``tool_choice: "required"`` is not enforced with the
    ``openai`` parser (as with qwen3_coder), and the request is not refused either."""
    if (
        importlib.util.find_spec("llguidance") is None
        and importlib.util.find_spec("xgrammar") is None
    ):
        pytest.skip("no grammar engine installed")
    from resin.server.structured import StructuredOutputs
    from resin.structured_output import GrammarRegistry
    from resin.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(checkpoint)
    structured = StructuredOutputs(
        GrammarRegistry(), tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, TOOL
    )
    assert not structured.compiler.supports_tool_calls
    assert structured.tool_grammar(WEATHER_TOOLS, "required", ["tools[0]"]) is None


def test_server_chat_and_anthropic_tool_call(served: Any) -> None:
    from tests.scripted_tool_calls import check_anthropic, check_openai

    served.script(SCRIPT_CALL)
    check_openai(served, MODEL, ("<|", "|>", "commentary", "functions."))
    check_anthropic(served, MODEL)


def test_server_chat_answer_streamed_and_not(served: Any) -> None:
    import openai

    served.script(SCRIPT_ANSWER)
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="x", max_retries=0)
    messages: Any = [{"role": "user", "content": "Weather?"}]
    # skip_special_tokens: true is overridden: the parsers need the markers (and remove them).
    for extra in ({}, {"skip_special_tokens": True}):
        choice = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=200, extra_body=extra
        ).choices[0]
        assert choice.finish_reason == "stop"
        assert choice.message.content == "It is sunny in Oslo."
        assert (choice.message.model_extra or {}).get("reasoning") == "Easy one."
    content = reasoning = ""
    finish = None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=200, stream=True
    ):
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
            finish = c.finish_reason or finish
    assert (content, reasoning, finish) == ("It is sunny in Oslo.", "Easy one.", "stop")


def test_server_responses_reasoning_and_function_call(served: Any) -> None:
    import openai

    served.script(SCRIPT_CALL_BEFORE)
    client = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="x", max_retries=0)
    tools: Any = [
        {
            "type": "function",
            "name": "get_weather",
            "parameters": WEATHER_TOOLS[0]["function"]["parameters"],
        }
    ]
    for stream in (False, True):
        if stream:
            with client.responses.stream(model=MODEL, input="Weather?", tools=tools) as events:
                for _ in events:
                    pass
                response = events.get_final_response()
        else:
            response = client.responses.create(model=MODEL, input="Weather?", tools=tools)
        types = [item.type for item in response.output]
        assert types == ["reasoning", "message", "function_call"], types
        reasoning, message, call = response.output
        assert "".join(c.text for c in reasoning.content or []) == "Oslo, two days."  # type: ignore[union-attr]
        assert message.content[0].text == "Checking."  # type: ignore[union-attr]
        assert call.name == "get_weather" and call.status == "completed"  # type: ignore[union-attr]
        assert json.loads(call.arguments) == {"city": "Oslo", "days": 2}  # type: ignore[union-attr]


def test_server_prompt_renders_earlier_reasoning_as_thinking(served: Any) -> None:
    """A reasoning_content sent back reaches a gpt-oss template as ``thinking``."""
    import httpx

    served.script(SCRIPT_ANSWER)
    body = {
        "model": MODEL,
        "max_tokens": 5,
        "return_token_ids": True,
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "reasoning_content": "Look it up.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    }
    reply = httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=60).json()
    prompt = served.tokenizer.decode(reply["prompt_token_ids"])
    assert "<|channel|>analysis<|message|>Look it up.<|end|>" in prompt
    assert '<|message|>{"city": "Oslo"}<|call|>' in prompt


def test_replaying_our_own_call_turn_renders_for_gpt_oss(served: Any) -> None:
    """Our output for a call turn is reasoning + a preamble (content) + the call; a client sends
    it back as one assistant message, which gpt-oss's template refuses ("Cannot pass both
    content and thinking"). The server passes the preamble after the reasoning, as the
    template's analysis message (what it renders for either), and no final message."""
    import httpx

    from resin.server.chat_prompt import gpt_oss_replayable

    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    turn = {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "Look it up.",
        "tool_calls": [call],
    }
    assert gpt_oss_replayable([turn]) == [
        {**turn, "content": "", "reasoning_content": "Look it up.\n\nChecking."}
    ]
    answer = {"role": "assistant", "content": "Sunny.", "reasoning_content": "Easy."}
    assert gpt_oss_replayable([answer]) == [answer]  # only call turns are changed
    served.script(SCRIPT_ANSWER)
    body = {
        "model": MODEL,
        "max_tokens": 5,
        "return_token_ids": True,
        "messages": [
            {"role": "user", "content": "Weather?"},
            turn,
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    }
    reply = httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=60).json()
    prompt = served.tokenizer.decode(reply["prompt_token_ids"])
    assert "<|channel|>analysis<|message|>Look it up.\n\nChecking.<|end|>" in prompt
    assert "<|channel|>final<|message|>Checking." not in prompt
