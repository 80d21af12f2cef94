"""DeepSeek-V3.2 / V4 DSML tool calls (resin/server/parsers/dsml.py) and their defaults.

Every case goes through ``tests.test_server_parsers.check``: fed whole, one character at a time
and at random split points, with the same content, reasoning and calls each time and a
well-formed event stream.
"""

from __future__ import annotations

import json
import random

import pytest

from resin.server.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ContentDelta,
    OutputParser,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    default_parsers,
)
from resin.server.parsers.dsml import DsmlToolParser, read_tag
from tests.test_server_parsers import WEATHER_TOOLS, check

D = "｜DSML｜"
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
NAMES = ("deepseek_dsml", "deepseek_v32", "deepseek_v4")


def param(name: str, value: object, *, space: str = "") -> str:
    """One parameter as DeepSeek's encoder writes it (``string="true"`` for str values)."""
    is_str = isinstance(value, str)
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    flag = "true" if is_str else "false"
    return f'<{D}{space}parameter name="{name}" string="{flag}">{text}</{D}{space}parameter>'


def invoke(name: str, args: dict, *, space: str = "") -> str:
    params = "\n".join(param(k, v, space=space) for k, v in args.items())
    return f'<{D}{space}invoke name="{name}">\n{params}\n</{D}{space}invoke>'


def block(*invokes: str, outer: str = "tool_calls", space: str = "") -> str:
    return f"<{D}{space}{outer}>\n" + "\n".join(invokes) + f"\n</{D}{space}{outer}>"


def args(result, i: int = 0) -> dict:
    return json.loads(result.calls[i][1])


# --- registry ------------------------------------------------------------------------------


def test_names_and_defaults():
    for name in NAMES:
        assert TOOL_PARSERS[name] is DsmlToolParser
    assert "deepseek_v4" in REASONING_PARSERS
    assert default_parsers("deepseek_v4") == ("deepseek_v4", "deepseek_v4")
    assert default_parsers("deepseek_v32") == ("deepseek_v32", "deepseek_v3")
    assert default_parsers("deepseek_v3") == ("deepseek_v3", "deepseek_v3")  # unchanged


# --- the format ----------------------------------------------------------------------------


@pytest.mark.parametrize("outer", ["function_calls", "tool_calls"])
@pytest.mark.parametrize("name", NAMES)
def test_issue_example(outer, name):
    text = "我来查一下。\n\n" + block(
        invoke("get_weather", {"city": "北京", "days": 3}), outer=outer
    )
    r = check(text, name, tools=WEATHER_TOOLS)
    assert r.content == "我来查一下。"
    assert r.calls == [("get_weather", '{"city": "北京", "days": 3}')]


def test_v41_spaced_tag_names():
    text = block(invoke("get_weather", {"city": "Oslo"}, space=" "), outer="calls", space=" ")
    r = check(text, "deepseek_v4", tools=WEATHER_TOOLS)
    assert r.content == "" and args(r) == {"city": "Oslo"}


def test_several_invokes_are_several_calls_and_several_blocks_continue_indices():
    first = block(invoke("a", {"x": 1}), invoke("b", {}))
    second = block(invoke("c", {"y": [1, "z"]}), outer="function_calls")
    r = check(f"One.\n\n{first}\n\nTwo.\n\n{second}", "deepseek_dsml")
    assert [name for name, _ in r.calls] == ["a", "b", "c"]
    assert [json.loads(a) for _, a in r.calls] == [{"x": 1}, {}, {"y": [1, "z"]}]
    assert r.content == "One.\n\nTwo."


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("3", 3),
        ("-2.5", -2.5),
        ("true", True),
        ("null", None),
        ('{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
        ('["x", 2]', ["x", 2]),
        ('"quoted"', "quoted"),
        (" 7 \n", 7),
        ("not json", "not json"),  # no schema: the raw string
        ("NaN", "NaN"),  # not JSON: never written as NaN
        ("1e999", "1e999"),  # overflows a float: kept as text
    ],
)
def test_string_false_values_are_json(raw, expected):
    text = f'<{D}tool_calls><{D}invoke name="f"><{D}parameter name="v" string="false">{raw}</{D}parameter></{D}invoke></{D}tool_calls>'
    r = check(text, "deepseek_dsml")
    assert args(r) == {"v": expected}


def test_string_false_that_is_no_json_is_converted_by_the_schema():
    text = block(
        f'<{D}invoke name="get_weather">\n'
        f"<{D}parameter name=\"opts\" string=\"false\">{{'unit': 'C'}}</{D}parameter>\n"
        f'<{D}parameter name="metric" string="false">True</{D}parameter>\n'
        f'<{D}parameter name="days" string="false">three</{D}parameter>\n</{D}invoke>'
    )
    r = check(text, "deepseek_dsml", tools=WEATHER_TOOLS)
    assert args(r) == {"opts": {"unit": "C"}, "metric": True, "days": "three"}


@pytest.mark.parametrize(
    "value",
    ["  padded  ", "\nline one\nline two\n", '{"not": "parsed"}', "42", "a < b > c", "", "日本"],
)
def test_string_true_values_are_verbatim(value):
    text = block(f'<{D}invoke name="get_weather">\n{param("city", value)}\n</{D}invoke>')
    r = check(text, "deepseek_dsml", tools=WEATHER_TOOLS)
    assert args(r) == {"city": value}


def test_string_true_wins_over_a_numeric_schema():
    text = block(invoke("get_weather", {"days": "3"}))  # the model chose string="true"
    assert args(check(text, "deepseek_dsml", tools=WEATHER_TOOLS)) == {"days": "3"}


def test_string_attribute_case_and_spaces_are_lenient():
    text = block(
        f'<{D}invoke name="f">\n<{D}parameter name = "a" string="True">1</{D}parameter>\n'
        f'<{D}parameter string=" FALSE " name="b">[1]</{D}parameter>\n</{D}invoke>'
    )
    assert check(text, "deepseek_dsml").calls == [("f", '{"a": "1", "b": [1]}')]


def test_missing_string_attribute_follows_the_schema():
    text = block(
        f'<{D}invoke name="get_weather">\n<{D}parameter name="days">4</{D}parameter>\n'
        f'<{D}parameter name="city">Rome</{D}parameter>\n</{D}invoke>'
    )
    r = check(text, "deepseek_dsml", tools=WEATHER_TOOLS)
    assert args(r) == {"days": 4, "city": "Rome"}


def test_json_body_invoke_streams_its_object():
    text = block(f'<{D}invoke name="get_weather">\n{{"city": "Lima", "days": 2}}\n</{D}invoke>')
    r = check(text, "deepseek_dsml", tools=WEATHER_TOOLS)
    assert args(r) == {"city": "Lima", "days": 2}
    parser = OutputParser("deepseek_dsml")
    events = parser.feed(f'<{D}tool_calls>\n<{D}invoke name="f">\n{{"q": "hel')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgumentsDelta]
    assert events[1].text == '{"q": "hel'


def test_string_values_stream_as_they_arrive():
    parser = OutputParser("deepseek_v4", tools=WEATHER_TOOLS)
    events = parser.feed(f'Ok.\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n')
    assert [type(e) for e in events[1:]] == [ToolCallStart]
    assert events[0].text == "Ok." and events[1].name == "get_weather"
    events = parser.feed(f'<{D}parameter name="city" string="true">San Fr')
    assert events == [ToolCallArgumentsDelta(0, '{"city": "San Fr')]
    # The value ends at the first DSML marker; its tag is read as structure.
    events = parser.feed(f"ancisco</{D}par")
    assert events == [ToolCallArgumentsDelta(0, 'ancisco"')]
    assert parser.feed(f'ameter>\n<{D}parameter name="days" string="false">1') == []
    events = parser.feed(f"0</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")
    assert events == [
        ToolCallArgumentsDelta(0, ', "days": 10}'),
        ToolCallEnd(0, '{"city": "San Francisco", "days": 10}'),
    ]
    assert parser.finish() == []


def test_markers_are_held_back_not_leaked():
    parser = OutputParser("deepseek_v4")
    assert parser.feed("Hello <") == [ContentDelta("Hello")]
    assert parser.feed("｜DS") == []
    assert parser.feed("ML｜tool_calls>\n<｜DSML｜invoke") == []
    (start,) = parser.feed(' name="f">')
    assert isinstance(start, ToolCallStart) and (start.index, start.name) == (0, "f")
    events = parser.feed("</｜DSML｜invoke></｜DSML｜tool_calls>") + parser.finish()
    assert events == [ToolCallArgumentsDelta(0, "{}"), ToolCallEnd(0, "{}")]
    assert parser.content_text == "Hello"


def test_every_prefix_of_a_tag_waits_for_more():
    # A tag arriving one character at a time is never rejected before it is complete.
    rng = random.Random("tags")
    names = ["invoke", "parameter", "calls", "tool_calls"]
    for _ in range(300):
        attrs = "".join(
            rng.choice([" ", "  ", "\n "])
            + rng.choice(["name", "string", "x-y"])
            + rng.choice(["=", " =", "= ", " = "])
            + '"'
            + rng.choice(["", "get_weather", "a b", "True", " FALSE "])
            + '"'
            for _ in range(rng.randint(0, 3))
        )
        tag = rng.choice(["", " "]) + rng.choice(names) + attrs + rng.choice(["", " "])
        assert read_tag(tag + ">", True) is not False, tag
        for end in range(len(tag) + 1):
            assert read_tag(tag[:end], False) is None, (tag, end)


# --- leniency and malformed output ---------------------------------------------------------


def test_bare_invoke_without_block_is_a_call():
    r = check(f"Sure. {invoke('a', {'x': 'y'})} done", "deepseek_dsml")
    assert r.calls == [("a", '{"x": "y"}')] and r.content == "Sure. done"


def test_forgotten_end_tags_are_closed_by_what_follows():
    text = (
        f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
        f'<{D}parameter name="city" string="true">Paris\n'  # no </parameter>
        f'<{D}parameter name="days" string="false">2</{D}parameter>\n'  # no </invoke>
        f'<{D}invoke name="b">\n<{D}parameter name="x" string="true">1</{D}parameter>\n'
        f"</{D}tool_calls>after"
    )
    r = check(text, "deepseek_dsml", tools=WEATHER_TOOLS)
    assert r.calls == [("get_weather", '{"city": "Paris\\n", "days": 2}'), ("b", '{"x": "1"}')]
    assert r.content == "after"


@pytest.mark.parametrize(
    "text, calls",
    [
        (
            f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="true">cut',
            [("f", '{"a": "cut"}')],
        ),
        (
            f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="false">[1, 2',
            [("f", '{"a": "[1, 2"}')],
        ),
        (f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" str', [("f", "{}")]),
        (f'<{D}tool_calls>\n<{D}invoke name="f">\n{{"a": [1, "x', [("f", '{"a": [1, "x"]}')]),
        (f'<{D}tool_calls>\n<{D}invoke name="f">', [("f", "{}")]),
    ],
)
def test_cut_off_calls_are_closed_with_what_was_read(text, calls):
    assert check(text, "deepseek_dsml").calls == calls


@pytest.mark.parametrize(
    "text",
    [
        f"Text <{D}tool_calls>not a call</{D}tool_calls> after",
        f"Cut off <{D}tool_calls>\n",
        f"Cut off <{D}tool_ca",
        f"<{D}tool_calls>\n</{D}tool_calls>",
        f'<{D}tool_calls>\n<{D}invoke name="{{{{ tc.name }}}}">\n</{D}invoke>\n</{D}tool_calls>',
        f'<{D}invoke name="get weather">x</{D}invoke>',
        f"The <{D}unknown> tag and a stray </{D}invoke> end",
        f"<{D} is a token",
        f'<{D}invoke name="a"<b>',
        f"</{D}tool_calls> before any call",
    ],
)
def test_markers_stay_text_when_no_call_forms(text):
    r = check(text, "deepseek_dsml")
    assert r.calls == [] and r.content == text


def test_after_a_call_stray_end_tags_drop_and_text_ends_the_block():
    call = invoke("a", {})
    text = f"<{D}tool_calls>\n{call}\n</{D}invoke>\nThen prose.</{D}tool_calls> x"
    r = check(text, "deepseek_dsml")
    assert r.calls == [("a", "{}")] and r.content == "\nThen prose. x"


def test_duplicate_parameters_keep_the_first():
    text = block(
        f'<{D}invoke name="f">\n{param("a", "one")}\n{param("a", "two")}\n{param("b", 2)}\n'
        f"{param('b', 3)}\n</{D}invoke>"
    )
    assert check(text, "deepseek_dsml").calls == [("f", '{"a": "one", "b": 2}')]


def test_invalid_json_body_keeps_the_valid_part():
    text = block(f'<{D}invoke name="f">\n{{"a": 1, "b": oops}}\n</{D}invoke>')
    r = check(text, "deepseek_dsml")
    assert r.calls == [("f", '{"a": 1}')] and r.content == "oops}"


def test_declared_tool_names_are_accepted_as_written():
    tools = [{"type": "function", "function": {"name": "my tool", "parameters": {}}}]
    text = block(invoke("my tool", {"x": 1}))
    assert check(text, "deepseek_dsml", tools=tools).calls == [("my tool", '{"x": 1}')]
    assert check(text, "deepseek_dsml").calls == []


def test_older_deepseek_shapes_are_read_too():
    # DeepSeek-V3.2-Exp has model_type deepseek_v32 and writes the V3.1 shape.
    text = f'Ok.{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Rome"}}{DS_END}{DS_CALLS_END}'
    r = check(text, "deepseek_v32", tools=WEATHER_TOOLS)
    assert r.content == "Ok." and r.calls == [("get_weather", '{"city": "Rome"}')]
    mixed = text + "\n\n" + block(invoke("get_weather", {"city": "Oslo"}))
    assert [json.loads(a)["city"] for _, a in check(mixed, "deepseek_v32").calls] == [
        "Rome",
        "Oslo",
    ]


# --- reasoning -----------------------------------------------------------------------------


def test_v4_thinking_prefilled_then_calls():
    call = block(invoke("get_weather", {"city": "SF"}))
    r = check(
        f"Need weather.</think>Checking.\n\n{call}",
        "deepseek_v4",
        "deepseek_v4",
        reasoning_started=True,
    )
    assert (r.reasoning, r.content) == ("Need weather.", "Checking.")
    assert r.calls == [("get_weather", '{"city": "SF"}')]
    # Thinking off (the template pre-filled </think>: the server passes no reasoning parser), or
    # a template that pre-fills nothing: all content.
    r = check(f"Checking.\n\n{call}", "deepseek_v4", "deepseek_v4")
    assert (r.reasoning, r.content) == ("", "Checking.") and len(r.calls) == 1


def test_call_block_ends_unterminated_reasoning():
    call = block(invoke("get_weather", {"city": "SF"}))
    r = check(f"The user wants SF.\n\n{call}", "deepseek_v4", "deepseek_v4", reasoning_started=True)
    assert r.reasoning == "The user wants SF.\n\n" and r.content == ""
    assert r.calls == [("get_weather", '{"city": "SF"}')]
    # A DSML tag named in reasoning that makes no call stays reasoning.
    text = f"Use <{D}tool_calls> blocks.</think>Done."
    r = check(text, "deepseek_v4", "deepseek_v4", reasoning_started=True)
    assert (r.reasoning, r.content, r.calls) == (f"Use <{D}tool_calls> blocks.", "Done.", [])


def test_call_inside_closed_think_stays_reasoning():
    call = block(invoke("get_weather", {"city": "SF"}))
    r = check(f"<think>{call}</think>No call.", "deepseek_v4", "deepseek_v4")
    assert r.calls == [] and r.reasoning == call and r.content == "No call."


# --- randomized ----------------------------------------------------------------------------

WORDS = ["Sure", " thing", ".", "\n", " a < b", " <b>", " {x}", " é日本", ' "q"', " \\", "｜"]
VALUE_CHARS = 'ab "\\\n<>{}[],:;é日\t/｜'


def test_random_well_formed_outputs_parse_to_what_was_rendered():
    rng = random.Random("dsml")
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
                        "o": {"type": "object"},
                    }
                },
            },
        }
        for i in range(3)
    ]
    for trial in range(40):
        thinking = rng.random() < 0.4
        reasoning = "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 4)))
        content = "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 5)))
        calls = []
        for _ in range(rng.randint(1, 3)):
            call_args: dict = {}
            if rng.random() < 0.8:
                call_args["s"] = "".join(rng.choice(VALUE_CHARS) for _ in range(rng.randint(0, 12)))
            if rng.random() < 0.5:
                call_args["n"] = rng.randint(-5, 10**6)
            if rng.random() < 0.3:
                call_args["l"] = [1, "x", {"y": None}]
            if rng.random() < 0.2:
                call_args["o"] = {"k": [True, 1.5]}
            calls.append((f"t{rng.randint(0, 2)}", call_args))
        space = " " if rng.random() < 0.2 else ""
        outer = "calls" if space else rng.choice(["function_calls", "tool_calls"])
        body = block(*(invoke(n, a, space=space) for n, a in calls), outer=outer, space=space)
        text = (reasoning + "</think>" if thinking else "") + content + "\n\n" + body
        tail = rng.choice(["", "\n", "\n\nDone.\n", " Done."])
        text += tail
        r = check(
            text,
            rng.choice(NAMES),
            "deepseek_v4",
            seed=trial,
            splits=8,
            tools=tools,
            reasoning_started=thinking,
        )
        assert r.reasoning == (reasoning if thinking else "")
        assert r.content == content.rstrip() + tail.rstrip()
        assert [(name, json.loads(a)) for name, a in r.calls] == calls
        assert D not in r.content


PIECES = [
    block(invoke("f", {"a": "x", "b": 2})),
    invoke("g", {}),
    f"<{D}tool_calls>",
    f"</{D}tool_calls>",
    f'<{D}invoke name="h">',
    f"</{D}invoke>",
    f'<{D}parameter name="p" string="true">',
    f'<{D}parameter name="q" string="false">',
    f"</{D}parameter>",
    f"<{D}",
    "<｜",
    "{",
    '"}',
    "Hello",
    " ",
    "\n",
    "<think>",
    "</think>",
    DS_CALL,
]


@pytest.mark.parametrize("reasoning", [None, "deepseek_v4", "deepseek_r1"])
def test_random_mixtures_never_raise_and_are_split_invariant(reasoning):
    rng = random.Random(f"dsml-{reasoning}")
    for trial in range(60):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 10)))
        check(
            text,
            rng.choice(NAMES),
            reasoning,
            seed=trial,
            splits=6,
            tools=WEATHER_TOOLS if rng.random() < 0.5 else None,
            reasoning_started=rng.random() < 0.3,
        )


def test_long_string_value_streams_in_linear_time():
    parser = OutputParser("deepseek_dsml")
    parser.feed(f'<{D}tool_calls>\n<{D}invoke name="write">\n<{D}parameter name="c" string="true">')
    sent = 0
    for _ in range(20_000):  # each "<" is held back until the next "x" shows it is no tag
        for event in parser.feed("x<"):
            assert isinstance(event, ToolCallArgumentsDelta)
            sent += len(event.text)
    assert sent == 2 * 20_000 - 1
    events = parser.feed(f"/{D}parameter></{D}invoke></{D}tool_calls>") + parser.finish()
    end = next(e for e in events if isinstance(e, ToolCallEnd))
    assert json.loads(end.arguments) == {"c": ("x<" * 20_000)[:-1]}
