"""Output parsers (resin/server/parsers): reasoning, content and tool calls out of streamed text.

The central property: for every parser, feeding the text whole, one character at a time, or at
random split points gives the same content, reasoning and calls, and the event stream is
well-formed (one start per call, indices 0, 1, 2, ..., argument fragments that concatenate to
the end's JSON object). ``check`` asserts all of that for each case.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from resin.server.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ContentDelta,
    OutputParser,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    default_parsers,
)
from resin.server.parsers.json_stream import JsonObjectStreamer
from resin.server.parsers.reasoning import ThinkReasoningParser

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "scale": {"type": "number"},
                    "metric": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "tags": {"type": "array"},
                    "zip": {"type": "string"},
                    "note": {"type": ["string", "null"]},
                },
            },
        },
    }
]


@dataclass
class Result:
    content: str
    reasoning: str
    calls: list[tuple[str, str]]  # (name, arguments JSON)
    events: list


def _summarize(events: list, parser: OutputParser) -> Result:
    open_calls: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    ended: list[int] = []
    calls = []
    for event in events:
        if isinstance(event, (ContentDelta, ReasoningDelta)):
            assert event.text, "empty delta"
            assert not open_calls, "text in the middle of a tool call"
        elif isinstance(event, ToolCallStart):
            assert event.index == len(names), "call indices must be 0, 1, 2, ... in order"
            assert not open_calls, "calls overlap"
            assert event.call_id.startswith("call_") and len(event.call_id) == 29
            int(event.call_id[5:], 16)
            names[event.index] = event.name
            open_calls[event.index] = []
        elif isinstance(event, ToolCallArgumentsDelta):
            assert event.index in open_calls, "arguments before start or after end"
            open_calls[event.index].append(event.text)
        elif isinstance(event, ToolCallEnd):
            parts = open_calls.pop(event.index)
            assert "".join(parts) == event.arguments
            assert isinstance(json.loads(event.arguments), dict)
            ended.append(event.index)
            calls.append((names[event.index], event.arguments))
    assert not open_calls, "a started call was never ended"
    assert ended == sorted(ended)
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert content == parser.content_text and reasoning == parser.reasoning_text
    assert [(c.name, c.arguments) for c in parser.tool_calls] == calls
    return Result(content, reasoning, calls, events)


def run(chunks: list[str], tool: str | None = None, reasoning: str | None = None, **kw) -> Result:
    parser = OutputParser(tool, reasoning, **kw)
    events: list = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    assert parser.finish() == []
    return _summarize(events, parser)


def random_splits(text: str, rng: random.Random) -> list[str]:
    cuts = (
        sorted(rng.sample(range(1, len(text)), k=rng.randint(0, min(len(text) - 1, 12))))
        if len(text) > 1
        else []
    )
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def check(
    text: str,
    tool: str | None = None,
    reasoning: str | None = None,
    seed: int = 0,
    splits: int = 40,
    **kw,
) -> Result:
    """The result of ``text`` fed whole, after asserting that feeding it one character at a time
    and at ``splits`` seeded random split points gives the same content, reasoning and calls."""
    whole = run([text], tool, reasoning, **kw)
    key = (whole.content, whole.reasoning, whole.calls)
    by_char = run(list(text), tool, reasoning, **kw)
    assert (by_char.content, by_char.reasoning, by_char.calls) == key, "char-by-char differs"
    rng = random.Random(seed)
    for _ in range(splits):
        split = run(random_splits(text, rng), tool, reasoning, **kw)
        assert (split.content, split.reasoning, split.calls) == key, "random split differs"
    return whole


def no_markers(content: str) -> None:
    for marker in (
        "<tool",
        "</tool",
        "<｜",
        "<function",
        "<parameter",
        "<arg_",
        "<minimax",
        "<invoke",
        "<|python_tag",
        "<think",
        "</think",
    ):
        assert marker not in content


# --- hermes ------------------------------------------------------------------------------------

HERMES_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "São Paulo", "days": 2}}\n</tool_call>'


def test_hermes_single_call():
    r = check(HERMES_ONE, "hermes")
    assert r.calls == [("get_weather", '{"city": "São Paulo", "days": 2}')]
    assert r.content == ""


def test_hermes_content_before_and_multiple_calls():
    text = (
        "Sure, checking both.\n\n"
        + HERMES_ONE
        + "\n"
        + HERMES_ONE.replace("São Paulo", "Oslo")
        + "\n"
    )
    r = check(text, "qwen25")
    assert r.content == "Sure, checking both."
    assert [c[0] for c in r.calls] == ["get_weather", "get_weather"]
    assert json.loads(r.calls[1][1]) == {"city": "Oslo", "days": 2}


def test_hermes_reasoning_and_call():
    text = (
        "<think>\nThe user wants weather. <tool_call>not parsed</tool_call>\n</think>\n\n"
        + HERMES_ONE
    )
    r = check(text, "hermes", "qwen3")
    assert r.reasoning == "\nThe user wants weather. <tool_call>not parsed</tool_call>\n"
    assert r.content == ""
    assert len(r.calls) == 1


def test_hermes_arguments_variants():
    text = (
        '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{"name": "b"}</tool_call>'
        '<tool_call>{"name": "c", "parameters": {"y": [1, 2]}}</tool_call>'
        '<tool_call>[{"name": "d", "arguments": {}}, {"name": "e", "arguments": {"z": null}}]</tool_call>'
    )
    r = check(text, "hermes")
    assert r.calls == [
        ("a", '{"x": 1}'),
        ("b", "{}"),
        ("c", '{"y": [1, 2]}'),
        ("d", "{}"),
        ("e", '{"z": null}'),
    ]


def test_hermes_malformed_json():
    # Arguments that turn invalid after the call started: the valid part, then the rest as content.
    bad = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"days": 3, "city": Paris}\n</tool_call>'
    )
    r = check("Hi " + bad + " " + HERMES_ONE, "hermes")
    assert r.calls == [
        ("get_weather", '{"days": 3}'),
        ("get_weather", '{"city": "São Paulo", "days": 2}'),
    ]
    assert r.content == "HiParis}"  # the space before the call went with it (whitespace rule)
    # A body that never reached its arguments object is not a call: raw content.
    for bad in [
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        "<tool_call>{'name': 'f'}</tool_call>",
    ]:
        r = check(bad, "hermes")
        assert r.content == bad and r.calls == []


def test_hermes_arguments_stream_as_they_arrive():
    parser = OutputParser("hermes")
    events = parser.feed(
        '<tool_call>\n{"name": "write", "arguments": {"path": "a.txt", "text": "line one\\nline'
    )
    assert isinstance(events[0], ToolCallStart) and events[0].name == "write"
    assert "".join(e.text for e in events[1:]) == '{"path": "a.txt", "text": "line one\\nline'
    events = parser.feed(' two", "n": 1')
    assert "".join(e.text for e in events) == ' two"'  # the number is released once it ends
    events = parser.feed("}}\n</tool_call>")
    assert [type(e) for e in events] == [ToolCallArgumentsDelta, ToolCallEnd]
    assert events[-1].arguments == '{"path": "a.txt", "text": "line one\\nline two", "n": 1}'
    # A cut-off call still ends with a JSON object (the part that arrived).
    r = check('<tool_call>\n{"name": "f", "arguments": {"a": [1, "x', "hermes")
    assert r.calls == [("f", '{"a": [1, "x"]}')]


def test_hermes_unterminated_call_at_finish():
    complete = check('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', "hermes")
    assert complete.calls == [("f", '{"a": 1}')] and complete.content == ""
    cut = check('Let me.\n<tool_call>\n{"name": "f", "argu', "hermes")
    assert cut.calls == [] and cut.content == 'Let me.\n<tool_call>\n{"name": "f", "argu'


def test_partial_markers_are_held_then_released():
    parser = OutputParser("hermes")
    assert parser.feed("x <to") == [ContentDelta("x")]
    assert parser.feed("y") == [ContentDelta(" <toy")]  # "<toy" can no longer become a marker
    parser = OutputParser("hermes")
    parser.feed("a <")
    assert parser.content_text == "a"
    parser.feed("b")
    assert parser.content_text == "a <b"  # "<b" starts no marker: not held
    parser.feed(" <tool_c")
    assert parser.content_text == "a <b"
    assert parser.finish() == [ContentDelta(" <tool_c")]  # never lose text


@pytest.mark.parametrize("tool", ["hermes", "glm45", "qwen3_coder"])
def test_tag_named_in_prose_is_released_at_once(tool):
    parser = OutputParser(tool)
    parser.feed("Wrap calls in <tool_call> tags like")
    assert parser.content_text == "Wrap calls in <tool_call> tags like"  # not held until the end
    assert parser.finish() == [] and parser.tool_calls == []


def test_tools_disabled_pass_markers_through():
    text = "<think>r</think>" + HERMES_ONE
    r = check(text, "hermes", "qwen3", enable_tools=False)
    assert r.reasoning == "r" and r.content == HERMES_ONE and r.calls == []
    assert check(HERMES_ONE, None).content == HERMES_ONE


def test_hermes_reads_qwen3_coder_xml_bodies():
    # Qwen3-Coder's config says qwen3_moe, so the default hermes parser may see its XML.
    text = "On it.\n" + coder_call("get_weather", {"days": "4"}) + "\n<function=x> stays text"
    r = check(text, "hermes", tools=WEATHER_TOOLS)
    assert (
        r.calls == [("get_weather", '{"days": 4}')]
        and r.content == "On it.\n<function=x> stays text"
    )


def test_tool_call_start_streams_before_later_content():
    parser = OutputParser("hermes")
    events = parser.feed(HERMES_ONE)
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd]
    assert events[0].index == 0 and events[0].name == "get_weather"


# --- JSON argument streaming ------------------------------------------------------------------


def _stream_json(chunks: list[str]) -> tuple[str, bool]:
    streamer = JsonObjectStreamer()
    released = ""
    for chunk in chunks:
        text, _ = streamer.feed(chunk)
        released += text
    return released + streamer.close(), streamer.error


@pytest.mark.parametrize(
    "obj",
    [
        {},
        {"a": 1},
        {
            "s": 'x"y\\z\n\u00e9日\t',
            "l": [1, 2.5, -3e5, True, False, None, {"k": []}],
            "o": {"p": {"q": [[]]}},
        },
    ],
)
def test_json_streamer_every_prefix_closes_to_valid_json(obj):
    for text in (json.dumps(obj), json.dumps(obj, ensure_ascii=False, indent=2)):
        whole, error = _stream_json([text])
        assert not error and json.loads(whole) == obj
        assert _stream_json(list(text)) == (whole, False)
        for cut in range(len(text)):
            prefix, error = _stream_json([text[:cut]])
            assert not error
            json.loads(prefix)  # what was released so far always completes to JSON


def test_json_streamer_invalid_input():
    assert _stream_json(['{"a": 1, "b": tru']) == ('{"a": 1}', False)
    assert _stream_json(['{"a": [1, {"b": "c\\u12']) == ('{"a": [1, {"b": "c"}]}', False)
    assert _stream_json(['{"a": "line\nbreak"}']) == (
        '{"a": "line\\nbreak"}',
        False,
    )  # raw newline escaped
    for bad in [
        "{'a': 1}",
        '{"a": 01}',
        '{"a" 1}',
        '{"a": 1 2}',
        "[1]",
        '{"a": x}',
        '{"a": "\\q"}',
    ]:
        released, error = _stream_json(list(bad))
        assert error, bad
        json.loads(released)


# --- qwen3_coder -------------------------------------------------------------------------------


def coder_call(name: str, params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_schema_conversion():
    text = coder_call(
        "get_weather",
        {
            "city": "Paris",
            "days": "3",
            "scale": "1.5",
            "metric": "True",
            "opts": '{"a": [1]}',
            "tags": '["x", "y"]',
            "zip": "02139",
            "note": "null",
            "extra": "42",
        },
    )
    r = check(text, "qwen3_coder", tools=WEATHER_TOOLS)
    assert len(r.calls) == 1 and r.calls[0][0] == "get_weather"
    assert json.loads(r.calls[0][1]) == {
        "city": "Paris",
        "days": 3,
        "scale": 1.5,
        "metric": True,
        "opts": {"a": [1]},
        "tags": ["x", "y"],
        "zip": "02139",
        "note": None,
        "extra": "42",
    }
    assert r.content == ""
    # Without a schema every value is a string; a bad integer stays a string.
    assert json.loads(
        check(coder_call("get_weather", {"days": "soon"}), "qwen3_xml", tools=WEATHER_TOOLS).calls[
            0
        ][1]
    ) == {"days": "soon"}
    assert json.loads(
        check(coder_call("other", {"days": "3"}), "qwen3_coder", tools=WEATHER_TOOLS).calls[0][1]
    ) == {"days": "3"}


def test_qwen3_coder_streams_per_parameter():
    parser = OutputParser("qwen3_coder", tools=WEATHER_TOOLS)
    events = parser.feed(
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n"
    )
    assert events[0] == ContentDelta("Checking.")
    assert isinstance(events[1], ToolCallStart) and events[1].name == "get_weather"
    assert events[2] == ToolCallArgumentsDelta(0, '{"days": 2')
    events = parser.feed("<parameter=city>\nRo")  # a string parameter streams as it arrives
    assert events == [ToolCallArgumentsDelta(0, ', "city": "Ro')]
    events = parser.feed("me\n</parameter>\n</function>\n</tool_call>")
    assert events == [
        ToolCallArgumentsDelta(0, 'me"}'),
        ToolCallEnd(0, '{"days": 2, "city": "Rome"}'),
    ]


def test_qwen3_coder_multiple_calls_content_and_multiline_values():
    code = "def f():\n    return '</function>'\n"
    text = (
        "I'll write it.\n\n"
        + coder_call("write", {"path": "a.py", "content": code})
        + "\n"
        + coder_call("noargs", {})
        + "\n\n"
    )
    r = check(text, "qwen3_coder", "qwen3")
    assert r.content == "I'll write it."
    assert r.calls[0][0] == "write" and json.loads(r.calls[0][1]) == {
        "path": "a.py",
        "content": code,
    }
    assert r.calls[1] == ("noargs", "{}")
    no_markers(r.content)


def test_qwen3_coder_lenient_forms():
    # No <tool_call> wrapper; missing </function>; next call starts before the previous closed.
    text = "<function=a>\n<parameter=x>\n1\n</parameter>\n</tool_call>\n<tool_call>\n<function=b>\n<function=c>\n</function>"
    r = check(text, "qwen3_coder")
    assert r.calls == [("a", '{"x": "1"}'), ("b", "{}"), ("c", "{}")]
    assert r.content == ""


def test_qwen3_coder_reads_hermes_json_body():
    r = check(
        "Ok.\n" + HERMES_ONE + "\n" + coder_call("f", {"a": "1"}),
        "qwen3_coder",
        tools=WEATHER_TOOLS,
    )
    assert r.content == "Ok."
    assert r.calls == [("get_weather", '{"city": "São Paulo", "days": 2}'), ("f", '{"a": "1"}')]


def test_qwen3_coder_malformed_and_unterminated():
    assert (
        check("<tool_call>\nhello</tool_call>", "qwen3_coder").content
        == "<tool_call>\nhello</tool_call>"
    )
    r = check(
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nBer",
        "qwen3_coder",
        tools=WEATHER_TOOLS,
    )
    assert r.calls == [("get_weather", '{"city": "Ber"}')]
    r = check("ok <tool_call>\n<function=get_wea", "qwen3_coder")
    assert r.calls == [] and r.content == "ok <tool_call>\n<function=get_wea"


# --- deepseek ----------------------------------------------------------------------------------


def ds_v3(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


def ds_v31(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31"])
def test_deepseek_both_shapes(parser):
    text = (
        "Let me look.\n<｜tool▁calls▁begin｜>"
        + ds_v3("get_weather", '{"city": "Tokyo"}')
        + "\n"
        + ds_v31("function", '{"k": [1, {"a": "日本"}]}')
        + "<｜tool▁calls▁end｜>"
    )
    r = check(text, parser)
    assert r.content == "Let me look."
    assert r.calls == [
        ("get_weather", '{"city": "Tokyo"}'),
        ("function", '{"k": [1, {"a": "日本"}]}'),
    ]
    no_markers(r.content)


def test_deepseek_with_r1_reasoning_without_think_tag():
    text = (
        "I should call it.\n</think>\n\n<｜tool▁calls▁begin｜>"
        + ds_v31("f", "{}")
        + "<｜tool▁calls▁end｜>"
    )
    r = check(text, "deepseek_v31", "deepseek_r1")
    assert r.reasoning == "I should call it.\n" and r.content == "" and r.calls == [("f", "{}")]


def test_deepseek_malformed_and_unterminated():
    cut = ds_v31("f", '{"a": 1, "b": ')  # arguments cut short: the complete part
    r = check(
        "<｜tool▁calls▁begin｜>" + cut + ds_v31("g", '{"b": 2}') + "<｜tool▁calls▁end｜>",
        "deepseek_v3",
    )
    assert r.content == "" and r.calls == [("f", '{"a": 1}'), ("g", '{"b": 2}')]
    bad = "<｜tool▁call▁begin｜>no separator<｜tool▁call▁end｜>"
    r = check(
        "<｜tool▁calls▁begin｜>" + bad + ds_v31("g", "{}") + "<｜tool▁calls▁end｜>", "deepseek_v31"
    )
    assert r.content == bad and r.calls == [("g", "{}")]
    fenced = '<｜tool▁call▁begin｜>h<｜tool▁sep｜>```json\n{"c": 3}\n```<｜tool▁call▁end｜>'
    assert check(fenced, "deepseek_v31").calls == [("h", '{"c": 3}')]
    r = check('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>g<｜tool▁sep｜>{"b": 2}', "deepseek_v3")
    assert r.calls == [("g", '{"b": 2}')] and r.content == ""
    text = "x <｜end▁of▁sentence｜>"
    assert check(text, "deepseek_v3").content == text  # other <｜...｜> tokens are content


# --- glm45 -------------------------------------------------------------------------------------


def glm_call(name: str, pairs: dict[str, str]) -> str:
    return (
        f"<tool_call>{name}\n"
        + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs.items())
        + "</tool_call>"
    )


def dsml_call(name: str, args: dict) -> str:
    """One DSML invoke as DeepSeek-V3.2 / V4's encoder writes it."""
    params = "".join(
        f'<｜DSML｜parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</｜DSML｜parameter>\n"
        for k, v in args.items()
    )
    return f'<｜DSML｜invoke name="{name}">\n{params}</｜DSML｜invoke>'


def minimax_call(name: str, args: dict) -> str:
    """One invoke as MiniMax-M2's template writes it: a string as is, anything else as JSON."""
    params = "".join(
        f'<parameter name="{k}">{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}'
        "</parameter>\n"
        for k, v in args.items()
    )
    return f'<invoke name="{name}">\n{params}</invoke>'


def test_minimax_m2_calls_after_prefilled_reasoning_typed_by_schema():
    text = (
        "Oslo, two days.</think>\n\nChecking.\n<minimax:tool_call>\n"
        + minimax_call("get_weather", {"city": "Oslo", "days": 2, "metric": True})
        + "\n"
        + minimax_call("get_weather", {"city": "a < b </city>", "tags": ["x", 1]})
        + '\n<invoke name="ping">\n</invoke>\n</minimax:tool_call>'
    )
    r = check(text, "minimax_m2", "qwen3", tools=WEATHER_TOOLS, reasoning_started=True)
    assert (r.reasoning, r.content.strip()) == ("Oslo, two days.", "Checking.")
    assert [(name, json.loads(args)) for name, args in r.calls] == [
        ("get_weather", {"city": "Oslo", "days": 2, "metric": True}),
        ("get_weather", {"city": "a < b </city>", "tags": ["x", 1]}),
        ("ping", {}),
    ]
    # Without schemas every value is its text, verbatim (a trailing newline included).
    r = check(
        '<minimax:tool_call><invoke name="write"><parameter name="content">x = 1\n'
        '</parameter><parameter name="mode">7</parameter></invoke></minimax:tool_call>',
        "minimax_m2",
    )
    assert r.calls == [("write", '{"content": "x = 1\\n", "mode": "7"}')]


def test_minimax_m2_several_blocks_single_quotes_and_lenient_ends():
    text = (
        "<minimax:tool_call>\n<invoke name='get_weather'>\n<parameter name='days'>3</parameter>\n"
        "</invoke>\n</minimax:tool_call>\n<minimax:tool_call>\n"
        '<invoke name="get_weather">\n<parameter name="city">Paris\n'  # </parameter> forgotten
        '<parameter name="days">2\n'  # and </invoke>: closed by the next invoke
        '<invoke name="b">\n<parameter name="x">cut off'
    )
    r = check(text, "minimax_m2", tools=WEATHER_TOOLS)
    assert r.content == ""
    assert [(name, json.loads(args)) for name, args in r.calls] == [
        ("get_weather", {"days": 3}),
        ("get_weather", {"city": "Paris\n", "days": 2}),
        ("b", {"x": "cut off"}),
    ]


def test_minimax_m2_text_that_is_no_call():
    for text in (
        '<invoke name="f">\n<parameter name="a">1</parameter>\n</invoke> (no block)',
        "Use <minimax:tool_call> blocks.",
        "<minimax:tool_call>not a call</minimax:tool_call> x",
        '<minimax:tool_call><invoke name="{{ tc.name }}"></invoke></minimax:tool_call>',
        "a </minimax:tool_call> b",
    ):
        r = check(text, "minimax_m2", tools=WEATHER_TOOLS)
        assert (r.content, r.calls) == (text, []), text
    # After a call: a stray end tag is dropped, text in the block ends it (it is content).
    r = check(
        '<minimax:tool_call><invoke name="f"></invoke></invoke>\nDone.</minimax:tool_call>',
        "minimax_m2",
    )
    assert r.calls == [("f", "{}")] and r.content == "\nDone."


def test_minimax_m2_streams_string_values_as_they_arrive():
    parser = OutputParser("minimax_m2", tools=WEATHER_TOOLS)
    events = parser.feed(
        '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Os'
    )
    assert isinstance(events[0], ToolCallStart) and events[0].name == "get_weather"
    assert "".join(e.text for e in events[1:]) == '{"city": "Os'
    events = parser.feed('lo</parameter><parameter name="days">2</parameter></invoke>')
    assert "".join(e.text for e in events if isinstance(e, ToolCallArgumentsDelta)) == (
        'lo", "days": 2}'
    )
    assert isinstance(events[-1], ToolCallEnd)


def test_glm45_calls_with_reasoning_and_schema():
    text = (
        "<think>Need weather.</think>\nChecking.\n"
        + glm_call(
            "get_weather",
            {"city": "Beijing", "days": "5", "metric": "false", "tags": '["a"]', "zip": "007"},
        )
        + "\n"
        + glm_call("ping", {})
        + "\n"
    )
    r = check(text, "glm45", "glm45", tools=WEATHER_TOOLS)
    assert r.reasoning == "Need weather." and r.content == "\nChecking."
    assert json.loads(r.calls[0][1]) == {
        "city": "Beijing",
        "days": 5,
        "metric": False,
        "tags": ["a"],
        "zip": "007",
    }
    assert r.calls[1] == ("ping", "{}")
    no_markers(r.content)


def test_glm45_name_then_key_on_same_line_and_malformed():
    r = check("<tool_call>f<arg_key>a</arg_key><arg_value>x y</arg_value></tool_call>", "glm45")
    assert r.calls == [("f", '{"a": "x y"}')]
    bad = "<tool_call>not a name\n<arg_key>a</arg_key></tool_call>"
    assert check(bad, "glm45").content == bad
    bad = '<tool_call>\n{"name": "f", "arguments": [1]}</tool_call>'
    assert check(bad, "glm45").content == bad
    # A hermes JSON body inside the GLM markers is still a call.
    assert check(
        '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "glm45"
    ).calls == [("f", '{"a": 1}')]
    r = check("<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>par", "glm45")
    assert r.calls == [("f", '{"a": "par"}')]


# --- llama3_json -------------------------------------------------------------------------------


def test_llama3_json_calls():
    r = check('{"name": "get_weather", "parameters": {"city": "SF"}}', "llama3_json")
    assert r.calls == [("get_weather", '{"city": "SF"}')] and r.content == ""
    r = check(
        ' <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": "}{"}}\n',
        "llama3_json",
    )
    assert r.calls == [("a", "{}"), ("b", '{"x": "}{"}')] and r.content == ""
    r = check('{"name": "a", "parameters": {"s": "q\\"}]\\\\", "n": [1, {"m": 2}]}}', "llama3_json")
    assert json.loads(r.calls[0][1]) == {"s": 'q"}]\\', "n": [1, {"m": 2}]}


def test_llama3_json_content_and_non_calls():
    text = 'The JSON is {"name": "x", "parameters": {}}.'
    assert check(text, "llama3_json").content == text
    assert check('{"answer": 42}', "llama3_json").content == '{"answer": 42}'
    r = check('{"name": "a", "parameters": {}} and then some text', "llama3_json")
    assert r.calls == [("a", "{}")] and r.content == " and then some text"
    assert (
        check('{"parameters": {"x": 1}, "na', "llama3_json").content
        == '{"parameters": {"x": 1}, "na'
    )
    assert check("<|python_tag|>", "llama3_json").content == "<|python_tag|>"


def test_llama3_json_calls_come_whole():
    # No argument streaming: a call is emitted once its object is complete and valid.
    parser = OutputParser("llama3_json")
    assert parser.feed('{"name": "a", "par') == []
    assert parser.feed('ameters": {"q": "he') == []
    events = parser.feed('llo"}};{"name": "b",')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd]
    assert events[0].name == "a" and events[-1] == ToolCallEnd(0, '{"q": "hello"}')
    # Name after the arguments: decoded whole once the object closes.
    parser = OutputParser("llama3_json")
    assert parser.feed('{"parameters": {"q": 1}, "name": "c"') == []
    events = parser.feed("}")
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd]


def test_llama3_json_invalid_arguments():
    # Invalid arguments JSON is no call at all (not a call with the valid part): content.
    text = '{"name": "a", "parameters": {"x": 1, "y": oops}} bye'
    r = check(text, "llama3_json")
    assert r.calls == [] and r.content == text
    text = '{"name": "a", "parameters": {"x": [1, 2'  # cut off: never complete
    r = check(text, "llama3_json")
    assert r.calls == [] and r.content == text


# --- reasoning ---------------------------------------------------------------------------------


THINK_REASONING_PARSERS = sorted(
    name for name, cls in REASONING_PARSERS.items() if issubclass(cls, ThinkReasoningParser)
)


@pytest.mark.parametrize("name", THINK_REASONING_PARSERS)
def test_reasoning_with_think_tags(name):
    r = check("\n<think>\nstep 1\n</think>\n\nAnswer: 4", None, name)
    assert r.reasoning == "\nstep 1\n" and r.content == "\n\nAnswer: 4"
    r = check("<think>cut off", None, name)
    assert r.reasoning == "cut off" and r.content == ""


def test_reasoning_without_start_tag():
    assert check("plain answer </think> x", None, "qwen3").content == "plain answer </think> x"
    r = check("thinking...</think>answer", None, "deepseek_r1")
    assert (r.reasoning, r.content) == ("thinking...", "answer")
    r = check("thinking...</think>answer <think>", None, "qwen3", reasoning_started=True)
    assert (r.reasoning, r.content) == ("thinking...", "answer <think>")
    assert check("all reasoning </thin", None, "deepseek_r1").reasoning == "all reasoning </thin"
    assert check("a <think>b</think>", None, "glm45").content == "a <think>b</think>"


# --- registry ----------------------------------------------------------------------------------


def test_default_parsers():
    assert default_parsers("qwen2") == ("hermes", None)
    assert default_parsers("qwen3") == ("hermes", "qwen3")
    assert default_parsers("qwen3_moe") == ("hermes", "qwen3")
    assert default_parsers("qwen3_moe", model_id="Qwen/Qwen3-Coder-30B-A3B-Instruct") == (
        "qwen3_coder",
        None,
    )
    assert default_parsers("deepseek_v3") == ("deepseek_v3", "deepseek_v3")
    assert default_parsers("deepseek_v32") == ("deepseek_v32", "deepseek_v3")
    assert default_parsers("deepseek_v4") == ("deepseek_v4", "deepseek_v4")
    assert default_parsers("glm4_moe") == ("glm45", "glm45")
    assert default_parsers("glm5_next") == default_parsers("glm5_next_text") == ("glm47", "glm45")
    assert default_parsers("llama") == ("llama3_json", None)
    assert default_parsers("gpt_oss") == ("openai", "openai_gptoss")
    assert default_parsers("kimi_k2") == ("kimi_k2", "qwen3")
    assert default_parsers("minimax_m2") == ("minimax_m2", "qwen3")
    assert default_parsers("mistral") == (None, None) and default_parsers("mixtral") == (None, None)
    for tool, reasoning in [
        default_parsers(t)
        for t in (
            "qwen2",
            "qwen3",
            "deepseek_v3",
            "deepseek_v32",
            "deepseek_v4",
            "glm4_moe",
            "llama",
            "qwen3_5",
            "gpt_oss",
            "minimax_m2",
        )
    ]:
        assert tool in TOOL_PARSERS and (reasoning is None or reasoning in REASONING_PARSERS)
    with pytest.raises(ValueError, match="tool_parser"):
        OutputParser("nope")


# --- randomized: arbitrary mixes of pieces, every parser --------------------------------------

PIECES = {
    "hermes": [
        HERMES_ONE,
        "<tool_call>{bad}</tool_call>",
        "<tool_call>",
        "</tool_call>",
        '{"name": "x"}',
    ],
    "qwen3_coder": [
        coder_call("f", {"a": "1", "b": "<x>"}),
        "<function=",
        "</parameter>",
        "<parameter=p>",
        "<tool_call>\n",
    ],
    "deepseek_v3": [
        ds_v3("f", '{"a": 1}'),
        ds_v31("g", "{}"),
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜",
        "```",
    ],
    "glm45": [
        glm_call("f", {"days": "2"}),
        "<arg_key>",
        "<arg_value>",
        "<tool_call>",
        "</tool_call>",
    ],
    "llama3_json": ['{"name": "f", "parameters": {"a": 1}}', ";", "<|python_tag|>", "{", "}", '"'],
    "deepseek_v4": [
        "<｜DSML｜tool_calls>\n"
        + dsml_call("f", {"a": "x", "days": 2})
        + "\n</｜DSML｜tool_calls>",
        dsml_call("get_weather", {"city": "SF"}),
        "<｜DSML｜tool_calls>",
        '<｜DSML｜parameter name="city" string="true">',
        "</｜DSML｜parameter>",
        "</｜DSML｜invoke>",
        "<｜DSML｜",
    ],
    "kimi_k2": [
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|>',
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        "functions.get_weather:1",
        "<|",
    ],
    "minimax_m2": [
        "<minimax:tool_call>\n"
        + minimax_call("f", {"a": "x", "days": 2})
        + "\n</minimax:tool_call>",
        minimax_call("get_weather", {"city": "SF"}),
        "<minimax:tool_call>",
        "</minimax:tool_call>",
        '<parameter name="city">',
        "</parameter>",
        "</invoke>",
        "<invoke name=",
    ],
    "openai": [
        "<|channel|>analysis<|message|>Think.<|end|>",
        "<|start|>assistant<|channel|>final<|message|>",
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "SF"}',
        "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>",
        "<|channel|>",
        "<|message|>",
        "<|end|>",
        "<|call|>",
        "<|return|>",
        " to=",
        "<|",
    ],
}
COMMON = ["Hello", " ", "\n", "<", "<b>", "<think>", "</think>", "x < y", "é", "}"]


@pytest.mark.parametrize("tool", sorted(PIECES))
@pytest.mark.parametrize("reasoning", [None, "qwen3", "deepseek_r1", "openai_gptoss"])
def test_random_mixtures_are_split_invariant(tool, reasoning):
    rng = random.Random(f"{tool}-{reasoning}")
    for trial in range(60):
        pieces = PIECES[tool] + COMMON
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        check(text, tool, reasoning, seed=trial, splits=10, tools=WEATHER_TOOLS)


# --- randomized: well-formed outputs parse to exactly what was rendered ------------------------

WORDS = [
    "Sure",
    " thing",
    ".",
    "\n",
    " a < b",
    " <b>",
    " {x}",
    " é日本",
    " 100%",
    ' "quoted"',
    " \\",
    " ;",
]
VALUE_CHARS = 'ab "\\\n<>{}[],:;é日\t/'


def _render(tool: str, name: str, args: dict, rng: random.Random) -> str:
    if tool == "hermes":
        return (
            "<tool_call>\n"
            + json.dumps({"name": name, "arguments": args}, ensure_ascii=rng.random() < 0.5)
            + "\n</tool_call>"
        )
    if tool == "deepseek_v3":
        if rng.random() < 0.5:
            return ds_v3(name, json.dumps(args, indent=rng.choice([None, 2])))
        return ds_v31(name, json.dumps(args))
    if tool == "llama3_json":
        return json.dumps({"name": name, rng.choice(["parameters", "arguments"]): args})
    if tool == "deepseek_v4":
        return "<｜DSML｜tool_calls>\n" + dsml_call(name, args) + "\n</｜DSML｜tool_calls>"
    if tool == "minimax_m2":
        return "<minimax:tool_call>\n" + minimax_call(name, args) + "\n</minimax:tool_call>"
    if tool == "kimi_k2":
        return (
            f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{name}:{rng.randint(0, 9)}"
            f"<|tool_call_argument_begin|>{json.dumps(args, ensure_ascii=rng.random() < 0.5)}"
            "<|tool_call_end|><|tool_calls_section_end|>"
        )
    if tool == "qwen3_coder":
        return coder_call(
            name, {k: v if isinstance(v, str) else json.dumps(v) for k, v in args.items()}
        )
    return glm_call(name, {k: v if isinstance(v, str) else json.dumps(v) for k, v in args.items()})


@pytest.mark.parametrize(
    "tool",
    [
        "hermes",
        "qwen3_coder",
        "deepseek_v3",
        "deepseek_v4",
        "glm45",
        "llama3_json",
        "kimi_k2",
        "minimax_m2",
    ],
)
def test_random_well_formed_outputs(tool):
    rng = random.Random(tool)
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"t{i}",
                "parameters": {
                    "properties": {
                        "s": {"type": "string"},
                        "n": {"type": "integer"},
                        "l": {"type": "array"},
                    }
                },
            },
        }
        for i in range(3)
    ]
    for trial in range(40):
        thinking = rng.random() < 0.4
        reasoning = "".join(
            rng.choice(WORDS + ["<tool_call>", "<function="]) for _ in range(rng.randint(0, 4))
        )
        content = (
            ""
            if tool == "llama3_json"
            else "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 5)))
        )
        calls = []
        for _ in range(rng.randint(1, 3)):
            args: dict = {}
            if rng.random() < 0.8:
                args["s"] = "".join(rng.choice(VALUE_CHARS) for _ in range(rng.randint(0, 12)))
            if rng.random() < 0.5:
                args["n"] = rng.randint(-5, 10**6)
            if rng.random() < 0.3:
                args["l"] = [1, "x", {"y": None}]
            calls.append((f"t{rng.randint(0, 2)}", args))
        sep = "; " if tool == "llama3_json" else "\n"
        text = ("<think>" + reasoning + "</think>" if thinking else "") + content
        text += sep.join(_render(tool, name, args, rng) for name, args in calls)
        # Text after the calls keeps its leading whitespace; whitespace-only text is dropped.
        tail = rng.choice(["", "\n", "\n\nDone.\n", " Done.", "\n" + rng.choice(WORDS[:3])])
        text += tail
        r = check(text, tool, "qwen3", seed=trial, splits=10, tools=tools)
        assert r.reasoning == (reasoning if thinking else "")
        assert r.content == content.rstrip() + tail.rstrip()
        assert [(name, json.loads(args)) for name, args in r.calls] == calls
        no_markers(r.content)


def test_reasoning_found_inside_a_call_waits_for_the_calls_end():
    """A reasoning parser that finds reasoning markers inside a call's text (gpt-oss's analysis
    header inside a DeepSeek call here) must not put reasoning between the call's start and
    end: it follows the call, with nothing lost."""
    text = (
        "<｜tool▁call▁begin｜>write<｜tool▁sep｜>"
        '{"path": "a", "content": "日本"}<｜nce<|channel|>analysis<|message|>thought<｜tool▁call▁end｜>'
    )
    r = check(text, "deepseek_v31", "openai_gptoss", seed=0, splits=15, tools=WEATHER_TOOLS)
    kinds = [type(e).__name__ for e in r.events]
    start, end = kinds.index("ToolCallStart"), kinds.index("ToolCallEnd")
    assert "ReasoningDelta" not in kinds[start:end]
    assert r.calls == [("write", '{"path": "a", "content": "日本"}')]


# --- hostile-client fuzzing: tags in strings, surrogates, cut calls ------------------------------


def test_the_end_tag_inside_a_string_argument_is_text():
    """A call writing a file that holds ``</tool_call>``: the tag inside a JSON string is the
    string's text, streamed (head first) or read whole (arguments before the name)."""
    args = {"path": "t.py", "content": 'print("</tool_call>")\nx = 1\n'}
    streamed = json.dumps({"name": "write", "arguments": args})
    whole = json.dumps({"arguments": args, "name": "write"})
    for body in (streamed, whole):
        r = check(f"<tool_call>\n{body}\n</tool_call>\nDone.", "hermes")
        assert [(n, json.loads(a)) for n, a in r.calls] == [("write", args)]
        assert r.content == "\nDone."


@pytest.mark.parametrize(
    ("escaped", "value"),
    [
        ("x\\ud83d\\ude00y", "x\U0001f600y"),  # a pair: the character
        ("x\\ud83dy", "x\ufffdy"),  # a high half alone
        ("\\ude00z", "\ufffdz"),  # a low half alone
        ("\\ud83d\\ud83d\\ude00", "\ufffd\U0001f600"),
        ("\\ud83d\\n", "\ufffd\n"),
    ],
)
def test_json_streamer_never_releases_half_a_character(escaped, value):
    text = '{"a": "' + escaped + '"}'
    for chunks in ([text], list(text)):
        released, error = _stream_json(chunks)
        assert not error and json.loads(released) == {"a": value}
    # Cut between the halves of a pair: the high half is held, then dropped.
    cut, _ = _stream_json(['{"a": "x\\ud83d'])
    assert json.loads(cut) == {"a": "x"}


def test_a_whole_call_with_a_lone_surrogate_gets_the_replacement_character():
    r = check('<tool_call>\n{"arguments": {"c": "\\ud83d x"}, "name": "f"}\n</tool_call>', "hermes")
    assert [json.loads(a) for _, a in r.calls] == [{"c": "\ufffd x"}]


@pytest.mark.parametrize(
    "text",
    [
        "Sure.<tool_",
        'Sure.<tool_call>\n{"n',
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": ',
    ],
)
def test_a_call_cut_by_max_tokens_leaves_no_markup(text):
    """``finish(cut=True)`` (the generation hit max_tokens): what the tool parser still held, a
    call's start that never became a call, is dropped; at a natural end it is content."""
    parser = OutputParser("hermes")
    events = parser.feed(text) + parser.finish(cut=True)
    assert parser.content_text == "Sure." and parser.tool_calls == []
    assert all(not isinstance(e, ToolCallStart) for e in events)
    assert run([text], "hermes").content == text


@pytest.mark.parametrize("tool", ["hermes", "openai"])
def test_a_call_whose_arguments_turn_invalid_is_not_finished(tool):
    """``{"recursive": True}`` (Python's literal): the call ends with the valid part of its
    arguments and is marked ``cut``, so it is never reported as a finished call."""
    if tool == "hermes":
        text = '<tool_call>\n{"name": "rm", "arguments": {"path": "/x", "recursive": True}}\n</tool_call>'
    else:
        text = '<|start|>assistant to=functions.rm<|channel|>commentary json<|message|>{"path": "/x", "recursive": True}<|call|>'
    parser = OutputParser(tool)
    events = parser.feed(text) + parser.finish()
    (end,) = [e for e in events if isinstance(e, ToolCallEnd)]
    assert end.cut and json.loads(end.arguments) == {"path": "/x"}
