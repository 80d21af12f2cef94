"""Parser robustness (issue 17, "Parsers"): each class of malformed or unusual model output,
with the behaviour chosen for it. Every case goes through ``check`` (whole, char by char and
at random splits must agree, and the event stream must be well-formed).
"""

from __future__ import annotations

import json

import pytest

from resin.server.parsers import (
    OutputParser,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallStart,
    default_parsers,
)
from tests.test_server_parsers import WEATHER_TOOLS, check

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

WRITE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "mode": {"type": "integer"},
                },
            },
        },
    }
]

HERMES_SF = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "SF"}}\n</tool_call>'
CODER_SF = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSF\n</parameter>\n</function>\n</tool_call>"
GLM_SF = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>SF</arg_value>\n</tool_call>"
GLM47_SF = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>SF</arg_value></tool_call>"
DS_SF = f'{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "SF"}}{DS_END}{DS_CALLS_END}'
DS_V3_SF = f'{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "SF"}}\n```{DS_END}{DS_CALLS_END}'
LLAMA_SF = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "SF"}}'
D = "｜DSML｜"
DSML_SF = (
    f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">SF</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>'
)
SF = [("get_weather", '{"city": "SF"}')]


def args(result, i: int = 0) -> dict:
    return json.loads(result.calls[i][1])


# --- a call start marker ends reasoning the model never closed ---------------------------------

# (tool parser, reasoning parser, reasoning_started, output): the model opens a call without
# closing its reasoning; the reasoning ends at the marker and the call is made.
UNTERMINATED = [
    ("hermes", "qwen3", False, "<think>The user wants SF weather.\n" + HERMES_SF),
    (
        "hermes",
        "qwen3",
        True,
        "The user wants SF weather.\n" + HERMES_SF,
    ),  # template opened <think>
    ("qwen3_coder", "qwen3", False, "<think>The user wants SF weather.\n" + CODER_SF),
    (
        "qwen3_coder",
        "qwen3",
        True,
        "The user wants SF weather.\n" + CODER_SF[len("<tool_call>\n") :],
    ),  # bare <function=
    ("glm45", "glm45", False, "<think>The user wants SF weather.\n" + GLM_SF),
    ("glm47", "glm45", False, "<think>The user wants SF weather.\n" + GLM47_SF),
    ("deepseek_v3", "deepseek_r1", False, "The user wants SF weather.\n" + DS_V3_SF),
    ("deepseek_v31", "deepseek_v3", True, "The user wants SF weather.\n" + DS_SF),
    ("llama3_json", "deepseek_r1", False, "The user wants SF weather.\n" + LLAMA_SF),
    ("deepseek_v4", "deepseek_v4", True, "The user wants SF weather.\n" + DSML_SF),
    ("deepseek_v32", "deepseek_v3", False, "<think>The user wants SF weather.\n" + DSML_SF),
    ("deepseek_dsml", "deepseek_r1", False, "The user wants SF weather.\n" + DSML_SF),
]


@pytest.mark.parametrize("tool,reasoning,started,text", UNTERMINATED)
def test_call_start_ends_unterminated_reasoning(tool, reasoning, started, text):
    r = check(text, tool, reasoning, reasoning_started=started, tools=WEATHER_TOOLS)
    assert r.reasoning == "The user wants SF weather.\n"
    assert r.calls == SF and r.content == ""


def test_unterminated_reasoning_several_calls_and_text_after():
    text = "<think>Two cities." + HERMES_SF + "\n" + HERMES_SF.replace("SF", "LA") + "\nDone."
    r = check(text, "hermes", "qwen3")
    assert r.reasoning == "Two cities."
    assert [args(r, i) for i in range(2)] == [{"city": "SF"}, {"city": "LA"}]
    assert r.content == "\nDone."


@pytest.mark.parametrize(
    "tool,call",
    [
        ("hermes", HERMES_SF),
        ("qwen3_coder", CODER_SF),
        ("glm45", GLM_SF),
        ("deepseek_v31", DS_SF),
        ("deepseek_v4", DSML_SF),
    ],
)
def test_call_inside_closed_think_is_not_promoted(tool, call):
    # Chosen as vLLM does (and SGLang when </think> is there): a call drafted inside a closed
    # <think> block is reasoning text, not a call.
    text = "<think>Maybe:\n" + call + "\nNo, answer directly.</think>It is sunny."
    r = check(text, tool, "deepseek_r1", tools=WEATHER_TOOLS)
    assert r.reasoning == "Maybe:\n" + call + "\nNo, answer directly."
    assert r.calls == [] and r.content == "It is sunny."


def test_tag_named_in_unterminated_reasoning_stays_reasoning_and_streams():
    # Prose that names the tag is not a call: the reasoning stays reasoning, and is not held.
    parser = OutputParser("hermes", "qwen3")
    events = parser.feed("<think>Wrap it in <tool_call> tags, then think more")
    assert (
        "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        == "Wrap it in <tool_call> tags, then think more"
    )
    parser.finish()
    assert parser.tool_calls == [] and parser.content_text == ""
    # ... and a real call after such a mention still ends the reasoning.
    r = check("<think>Use <tool_call> tags. So:" + HERMES_SF, "hermes", "qwen3")
    assert r.reasoning == "Use <tool_call> tags. So:" and r.calls == SF
    # Cut off inside the call: no call formed, so it was reasoning after all.
    cut = '<think>Let me call <tool_call>\n{"name": "get_weather", "argu'
    r = check(cut, "hermes", "qwen3")
    assert r.reasoning == cut[len("<think>") :] and r.calls == [] and r.content == ""


def test_unterminated_reasoning_without_tools_stays_reasoning():
    r = check("<think>plan " + HERMES_SF, "hermes", "qwen3", enable_tools=False)
    assert r.reasoning == "plan " + HERMES_SF and r.calls == []


# --- qwen3_coder: a <parameter=...> whose </parameter> is missing ------------------------------


def coder(name: str, body: str, end: str = "</function>\n</tool_call>") -> str:
    return f"<tool_call>\n<function={name}>\n{body}{end}"


@pytest.mark.parametrize(
    "body,end,expected",
    [
        # closed by the next <parameter= (a non-text parameter: at once)
        (
            "<parameter=days>\n3\n<parameter=city>\nParis\n</parameter>\n",
            "</function>\n</tool_call>",
            {"days": 3, "city": "Paris"},
        ),
        # a string parameter: by the next parameter of the tool, decided at the call's end
        (
            "<parameter=city>\nParis\n<parameter=days>\n3\n</parameter>\n",
            "</function>\n</tool_call>",
            {"city": "Paris", "days": 3},
        ),
        # the last parameter, closed by </function> + </tool_call>, by </function> at the end, by </tool_call>
        (
            "<parameter=days>\n4\n<parameter=city>\nParis\n",
            "</function>\n</tool_call>",
            {"days": 4, "city": "Paris"},
        ),
        ("<parameter=city>\nParis\n", "</function>", {"city": "Paris"}),
        ("<parameter=city>\nParis\n", "</tool_call>", {"city": "Paris"}),
        # three parameters, the first two unclosed
        (
            "<parameter=city>\nRome\n<parameter=note>\nwarm\n<parameter=days>\n2\n</parameter>\n",
            "</function>\n</tool_call>",
            {"city": "Rome", "note": "warm", "days": 2},
        ),
    ],
)
def test_qwen3_coder_unclosed_parameter(body, end, expected):
    r = check(coder("get_weather", body, end), "qwen3_coder", tools=WEATHER_TOOLS)
    assert len(r.calls) == 1 and args(r) == expected and r.content == ""


def test_qwen3_coder_unclosed_parameter_then_next_call_and_no_schema():
    text = (
        coder("get_weather", "<parameter=city>\nParis\n", "</function>\n")
        + "\n"
        + coder("get_weather", "<parameter=city>\nRome\n</parameter>\n")
    )
    r = check(text, "qwen3_coder", tools=WEATHER_TOOLS)
    assert [args(r, i) for i in range(2)] == [{"city": "Paris"}, {"city": "Rome"}]
    # Without tools, any parameter name closes an unclosed value.
    r = check(coder("f", "<parameter=a>\nx\n<parameter=b>\ny\n</parameter>\n"), "qwen3_coder")
    assert args(r) == {"a": "x", "b": "y"}


# --- qwen3_coder: a literal </parameter> inside a value ----------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        'tag = "</parameter>"\nprint(tag)',  # followed by code
        "see </parameter> here",  # mid-line
        "a</parameter>b</parameter>c",  # twice
        "end of line </parameter>\nmore text",  # at a line end, then text
        "</parameter>",  # the whole value
        "x</parameter><parameter=zz>y",  # then a tag the schema does not declare, inline
        "done.\n</function>\n</tool_call>\nThen more.",  # a quoted call end, then text
    ],
)
def test_qwen3_coder_literal_parameter_end_in_value(value):
    text = coder(
        "write",
        f"<parameter=content>\n{value}\n</parameter>\n<parameter=path>\na.txt\n</parameter>\n",
    )
    r = check(text, "qwen3_coder", tools=WRITE_TOOLS)
    assert args(r) == {"content": value, "path": "a.txt"}


def test_qwen3_coder_quoted_call_in_value_keeps_keys_unique():
    # The value quotes a whole tool call (docs about the format): its tags are text, and the
    # outer call gets each key once.
    quoted = (
        "Call it like this:\n<tool_call>\n<function=write>\n<parameter=path>\nx.md\n</parameter>\n"
        "<parameter=content>\nhi\n</parameter>\n</function>\n</tool_call>\nThat is all."
    )
    text = coder(
        "write",
        f"<parameter=content>\n{quoted}\n</parameter>\n<parameter=path>\ndocs.md\n</parameter>\n",
    )
    r = check(text, "qwen3_coder", tools=WRITE_TOOLS)
    assert len(r.calls) == 1 and args(r) == {"content": quoted, "path": "docs.md"}
    # A parameter given twice keeps its first value: no duplicated key in the JSON text.
    text = coder(
        "write",
        "<parameter=path>\na\n</parameter>\n<parameter=path>\nb\n</parameter>\n<parameter=mode>\n1\n</parameter>\n"
        "<parameter=mode>\n2\n</parameter>\n",
    )
    r = check(text, "qwen3_coder", tools=WRITE_TOOLS)
    assert r.calls == [("write", '{"path": "a", "mode": 1}')]


def test_qwen3_coder_string_value_streams():
    parser = OutputParser("qwen3_coder", tools=WRITE_TOOLS)
    events = parser.feed(coder("write", "<parameter=content>\nline one\nline two", ""))
    assert isinstance(events[0], ToolCallStart)
    assert "".join(e.text for e in events[1:]) == '{"content": "line one\\nline two'
    events = parser.feed('\n</parameter> is "a tag"\n')  # a literal close: held, then released
    assert "".join(e.text for e in events) == '\\n</parameter> is \\"a tag\\"'
    events = parser.feed("</parameter>\n</function>\n</tool_call>")
    assert (
        events[-1].arguments == '{"content": "line one\\nline two\\n</parameter> is \\"a tag\\""}'
    )


# --- qwen3_coder: Python literals converted by the schema ---------------------------------------

PY_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "obj": {"type": "object"},
                    "arr": {"type": "array"},
                    "s": {"type": ["string", "null"]},
                    "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                    "m": {"type": "number", "nullable": True},
                    "b": {"type": "boolean"},
                },
            },
        },
    }
]


@pytest.mark.parametrize(
    "param,raw,expected",
    [
        ("obj", "{'k': 'v', 'none': None, 'yes': True}", {"k": "v", "none": None, "yes": True}),
        ("arr", "['a', 1, (2, 3)]", ["a", 1, [2, 3]]),
        ("obj", "\"{'k': 1}\"", {"k": 1}),  # a Python repr inside a JSON string
        ("s", "None", None),  # nullable string
        ("n", "None", None),  # anyOf with null
        ("m", "None", None),  # OpenAPI nullable
        ("b", "True", True),
    ],
)
def test_qwen3_coder_python_literals(param, raw, expected):
    r = check(
        coder("f", f"<parameter={param}>\n{raw}\n</parameter>\n"), "qwen3_coder", tools=PY_TOOLS
    )
    assert args(r) == {param: expected}


@pytest.mark.parametrize(
    "param,raw",
    [
        ("obj", "{'a': {1, 2}}"),
        ("obj", "__import__('os')"),
        ("arr", "{'a': 1}"),
        ("s", "none of these"),
    ],
)
def test_qwen3_coder_unconvertible_literals_stay_text(param, raw):
    r = check(
        coder("f", f"<parameter={param}>\n{raw}\n</parameter>\n"), "qwen3_coder", tools=PY_TOOLS
    )
    assert args(r) == {param: raw}


# --- names that are not function names ---------------------------------------------------------


@pytest.mark.parametrize(
    "tool,text",
    [
        (
            "qwen3_coder",
            "<tool_call>\n<function={{ tc.name }}>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
        ),
        ("qwen3_coder", "<function=get weather>\n</function>"),
        ("hermes", '<tool_call>\n{"name": "{{ tc.name }}", "arguments": {}}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"name": "get weather", "arguments": {"a": 1}}\n</tool_call>'),
        ("deepseek_v31", f"{DS_CALLS}{DS_CALL}{{{{ name }}}}{DS_SEP}{{}}{DS_END}{DS_CALLS_END}"),
        ("llama3_json", '{"name": "{{ tc.name }}", "parameters": {}}'),
        ("deepseek_v4", f'<{D}tool_calls>\n<{D}invoke name="{{{{ tc.name }}}}">\n</{D}invoke>'),
        ("deepseek_v32", f'<{D}invoke name="get weather">\n</{D}invoke>'),
    ],
)
def test_non_identifier_names_are_text(tool, text):
    r = check(text, tool)
    assert r.calls == [] and r.content == text


def test_declared_tool_names_are_accepted_as_written():
    tools = [{"type": "function", "function": {"name": "get weather", "parameters": {}}}]
    r = check("<function=get weather>\n</function>", "qwen3_coder", tools=tools)
    assert r.calls == [("get weather", "{}")]
    assert check("<function=mcp.fs/read-file>\n</function>", "qwen3_coder").calls == [
        ("mcp.fs/read-file", "{}")
    ]


# --- llama3_json --------------------------------------------------------------------------------


def test_llama3_json_text_before_python_tag():
    r = check("Let me check.<|python_tag|>" + LLAMA_SF[len("<|python_tag|>") :], "llama3_json")
    assert r.content == "Let me check." and r.calls == SF
    r = check(
        'Sure!\n\n<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}',
        "llama3_json",
    )
    assert r.content == "Sure!" and r.calls == [("a", "{}"), ("b", '{"x": 1}')]
    # A "{" after text is still text.
    text = 'Here: {"name": "a", "parameters": {}}'
    assert check(text, "llama3_json").content == text


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "a", "parameters": {"x": 1, "y": oops}}',
        '<|python_tag|>{"name": "a", "parameters": {"x": 1, "y": oops}}; {"name": "b", "parameters": {}}',
        'Hi <|python_tag|>{"name": "a", "parameters": {"x": [1, 2}}',
        '{"name": "a", "parameters": {"x": "unterminated',
    ],
)
def test_llama3_json_invalid_arguments_make_no_phantom_call(text):
    r = check(text, "llama3_json")
    assert r.calls == [] and r.content == text
    parser = OutputParser("llama3_json")
    assert not any(isinstance(e, ToolCallStart) for e in parser.feed(text))


# --- glm45 / glm47 ------------------------------------------------------------------------------


@pytest.mark.parametrize("tool", ["glm45", "glm47"])
def test_glm_quoted_numbers_follow_the_schema(tool):
    pairs = {"days": '"5"', "scale": '"1.5"', "metric": '"true"', "city": '"Paris"', "zip": "007"}
    text = (
        "<tool_call>get_weather"
        + "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in pairs.items())
        + "</tool_call>"
    )
    r = check(text, tool, tools=WEATHER_TOOLS)
    assert args(r) == {"days": 5, "scale": 1.5, "metric": True, "city": '"Paris"', "zip": "007"}
    # The same rule serves qwen3_coder.
    r = check(
        coder("get_weather", '<parameter=days>\n"7"\n</parameter>\n'),
        "qwen3_coder",
        tools=WEATHER_TOOLS,
    )
    assert args(r) == {"days": 7}


def test_glm_long_string_values_stream():
    parser = OutputParser("glm45", tools=WRITE_TOOLS)
    events = parser.feed("<tool_call>write\n<arg_key>content</arg_key>\n<arg_value>line one\nline")
    assert isinstance(events[0], ToolCallStart)
    assert "".join(e.text for e in events[1:]) == '{"content": "line one\\nline'
    events = parser.feed(" two</arg_")  # a possible </arg_value> is held
    assert events == [ToolCallArgumentsDelta(0, " two")]
    events = parser.feed("value>\n<arg_key>mode</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
    assert events[-1].arguments == '{"content": "line one\\nline two", "mode": 3}'
    r = check(
        "<tool_call>write<arg_key>content</arg_key><arg_value>a</arg_val b</arg_value></tool_call>",
        "glm47",
        tools=WRITE_TOOLS,
    )
    assert args(r) == {"content": "a</arg_val b"}


# --- deepseek ------------------------------------------------------------------------------------


def test_deepseek_v3_default_does_not_make_answers_reasoning():
    tool, reasoning = default_parsers("deepseek_v3")
    r = check("Paris is the capital of France.", tool, reasoning)
    assert (r.reasoning, r.content) == ("", "Paris is the capital of France.")
    r = check("<think>Easy.</think>Paris.", tool, reasoning)
    assert (r.reasoning, r.content) == ("Easy.", "Paris.")
    r = check(
        "Easy.</think>Paris.", tool, reasoning, reasoning_started=True
    )  # R1-0528 / V3.1 thinking
    assert (r.reasoning, r.content) == ("Easy.", "Paris.")
    assert default_parsers("deepseek_v32")[1] == reasoning
    # DeepSeek-V3.2 / V4: DSML calls; thinking is a pre-filled <think> (reasoning_started).
    for model_type in ("deepseek_v32", "deepseek_v4"):
        tool, reasoning = default_parsers(model_type)
        assert check("Paris.", tool, reasoning).content == "Paris."
        r = check("Easy.</think>" + DSML_SF, tool, reasoning, reasoning_started=True)
        assert (r.reasoning, r.content, r.calls) == ("Easy.", "", SF)


@pytest.mark.parametrize("tool", ["deepseek_v3", "deepseek_v31"])
@pytest.mark.parametrize(
    "text",
    [
        f"Text {DS_CALLS}not a call{DS_CALLS_END}",
        f"{DS_CALLS}{DS_CALL}no separator{DS_END}{DS_CALLS_END} after",
        f"Cut off {DS_CALLS}",
        f"Stray end {DS_CALLS_END} here",
        f"{DS_CALLS}{DS_CALL}{{{{ bad name }}}}{DS_SEP}{{}}{DS_END}",
    ],
)
def test_deepseek_markers_stay_text_when_no_call_forms(tool, text):
    r = check(text, tool)
    assert r.calls == [] and r.content == text


@pytest.mark.parametrize(
    "text",
    [
        f"Text <{D}tool_calls>not a call</{D}tool_calls>",
        f"<{D}function_calls>\nprose</{D}function_calls> after",
        f"Cut off <{D}tool_calls>",
        f"Stray end </{D}tool_calls> here",
        f"A <{D}bogus> tag",
    ],
)
def test_dsml_markers_stay_text_when_no_call_forms(text):
    r = check(text, "deepseek_v4")
    assert r.calls == [] and r.content == text


def test_dsml_block_with_a_call_drops_its_markers_and_stray_ends():
    r = check(f"Ok.\n\n{DSML_SF}\n</{D}tool_calls></{D}invoke> then text", "deepseek_v4")
    assert r.content == "Ok.\n then text" and r.calls == SF


def test_deepseek_block_with_a_call_still_drops_its_markers():
    bad = f"{DS_CALL}no separator{DS_END}"
    r = check(f"Ok.{DS_CALLS}{bad}{DS_CALL}g{DS_SEP}{{}}{DS_END}{DS_CALLS_END}", "deepseek_v31")
    assert r.content == "Ok." + bad and r.calls == [("g", "{}")]
