"""Property: for every parser — each tool parser, each reasoning parser, and reasoning + tools
chained as the server chains them (``OutputParser``) — any split of an output into deltas gives
the same content, reasoning and calls as parsing it whole.

Each case is fed whole, one character at a time, and at seeded random split points
(``tests.test_server_parsers.check``, which also checks that the event stream is well-formed).
The corpus per format covers well-formed calls, the malformed shapes the parsers are lenient
about, and the robustness classes of ``test_parsers_robustness.py``; each text is also wrapped in
reasoning (closed, unterminated, pre-filled) and run under every reasoning parser, with and
without ``reasoning_started``.
"""

from __future__ import annotations

import random

import pytest

from resin.server.parsers import REASONING_PARSERS, TOOL_PARSERS
from tests.test_server_parsers import WEATHER_TOOLS, check

DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

TOOLS = WEATHER_TOOLS + [
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
                    "opts": {"type": "object"},
                },
            },
        },
    }
]

HERMES = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "SF", "days": 2}}\n</tool_call>',
    'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "write", "arguments": {"path": "a", "content": "x\\ny"}}\n</tool_call>\nDone.',
    '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>[{"name": "b"}, {"name": "c", "parameters": {}}]</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"days": 3, "city": Paris}\n</tool_call> tail',
    '<tool_call>\n{"name": "{{ tc.name }}", "arguments": {}}\n</tool_call>',
    "Use <tool_call> tags for calls.",
    '<tool_call>\n{"name": "f", "arguments": {"a": [1, "x',
    '<tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}</tool_call>',
]

CODER = [
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSF\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "I'll write it.\n<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n"
    "def f():\n    return '</function>' + \"</parameter>\"\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>\n<tool_call>\n<function=write>\n"
    "<parameter=mode>\n1\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=write>\n<parameter=content>\nSee:\n<tool_call>\n<function=write>\n<parameter=path>\nx\n</parameter>\n"
    "</function>\n</tool_call>\nok\n</parameter>\n<parameter=path>\nd.md\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=write>\n<parameter=opts>\n{'a': None, 'b': (1, 2)}\n</parameter>\n<parameter=mode>\n\"7\"\n</parameter>\n"
    "<parameter=path>\na\n</parameter>\n<parameter=path>\nb\n</parameter>\n</function>\n</tool_call>",
    "<function=a>\n<parameter=x>\n1\n</parameter>\n</tool_call>\n<tool_call>\n<function=b>\n<function=c>\n</function>",
    "<tool_call>\n<function={{ tc.name }}>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\nhello</tool_call> and <function=get weather> too",
    "<tool_call>\n<function=write>\n<parameter=content>\ncut off </parameter> mid",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nBer",
]

DEEPSEEK = [
    f'Let me look.\n{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Tokyo"}}\n```{DS_END}\n'
    f'{DS_CALL}write{DS_SEP}{{"path": "a", "content": "日本"}}{DS_END}{DS_CALLS_END}',
    f'{DS_CALLS}{DS_CALL}no separator{DS_END}{DS_CALL}g{DS_SEP}{{"b": 2}}{DS_END}{DS_CALLS_END}',
    f"Text {DS_CALLS}not a call{DS_CALLS_END} after",
    f"Cut off {DS_CALLS}",
    f"Stray {DS_CALLS_END} end",
    f'{DS_CALLS}{DS_CALL}f{DS_SEP}{{"a": 1, "b": ',
    f'{DS_CALL}h{DS_SEP}```json\n{{"c": 3}}\n```{DS_END}',
    f"{DS_CALLS}{DS_CALL}{{{{ name }}}}{DS_SEP}{{}}{DS_END}{DS_CALLS_END}",
    "x <｜end▁of▁sentence｜>",
]

D = "｜DSML｜"
DSML = [
    f'Let me check.\n\n<{D}function_calls>\n<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">北京</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">3</{D}parameter>\n</{D}invoke>\n'
    f'<{D}invoke name="write">\n<{D}parameter name="content" string="true">a < b\n"q"</{D}parameter>\n'
    f'<{D}parameter name="opts" string="false">{{"k": [1, null]}}</{D}parameter>\n</{D}invoke>\n'
    f"</{D}function_calls>",
    f'<{D} calls>\n<{D} invoke name="write">\n<{D} parameter name="mode" string="false">7</{D} parameter>\n'
    f"</{D} invoke>\n</{D} calls> Done.",
    f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n{{"city": "Lima", "days": 2}}\n</{D}invoke>\n'
    f'<{D}invoke name="f">\n{{"a": 1, "b": oops}}\n</{D}invoke>\n</{D}tool_calls>',
    f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris\n'
    f'<{D}parameter name="days" string="false">2</{D}parameter>\n<{D}invoke name="b">\n</{D}tool_calls>after',
    f"Text <{D}tool_calls>not a call</{D}tool_calls> after",
    f'<{D}tool_calls>\n<{D}invoke name="{{{{ tc.name }}}}">\n</{D}invoke>\n</{D}tool_calls>',
    f'<{D}invoke name="a">\n<{D}parameter name="x" string="true">1</{D}parameter>\n</{D}invoke> bare',
    f'<{D}tool_calls>\n<{D}invoke name="write">\n<{D}parameter name="path" string="true">a</{D}parameter>'
    f'<{D}parameter name="path" string="true">b</{D}parameter></{D}invoke></{D}invoke>\nprose</{D}tool_calls>',
    f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Ber',
    f"The <{D} is a token, <{D}tool_ca",
    f'{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Rome"}}{DS_END}{DS_CALLS_END}',
]

GLM = [
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n"
    '<arg_value>"5"</arg_value>\n</tool_call>\n<tool_call>ping\n</tool_call>',
    "Checking.<tool_call>write<arg_key>content</arg_key><arg_value>line one\nline </arg_val two</arg_value>"
    "<arg_key>mode</arg_key><arg_value>3</arg_value></tool_call>",
    "<tool_call>not a name\n<arg_key>a</arg_key></tool_call>",
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>par",
    "<tool_call>write<arg_key>path</arg_key><arg_value>a</arg_value><arg_key>path</arg_key><arg_value>b</arg_value></tool_call>",
]

LLAMA = [
    '{"name": "get_weather", "parameters": {"city": "SF"}}',
    ' <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": "}{"}}\n',
    'Let me check.<|python_tag|>{"name": "get_weather", "parameters": {"city": "SF"}} and more',
    '{"name": "a", "parameters": {"x": 1, "y": oops}} bye',
    '{"name": "a", "parameters": {"x": [1, 2',
    'The JSON is {"name": "x", "parameters": {}}.',
    "<|python_tag|>",
    '{"name": "{{ tc.name }}", "parameters": {}}',
]

# gpt-oss harmony (parsers "openai" / "openai_gptoss"): markers are special tokens the server keeps.
H_AN = "<|channel|>analysis<|message|>Plan it.<|end|>"
H_FIN = "<|start|>assistant<|channel|>final<|message|>"
H_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
)
H_CALL_FIRST = "<|start|>assistant to=functions.write<|channel|>commentary json<|message|>"
HARMONY = [
    H_AN + H_FIN + "It is sunny.<|return|>",
    H_AN + H_FIN + "It is sunny.",
    H_AN
    + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    + H_CALL
    + '{"city":"Oslo","days":2}<|call|>',
    H_AN + H_CALL_FIRST + '{"path": "a.txt", "content": "x <| y\\n"}',
    ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Lima"}',
    "<|channel|>analysis<|message|>cut off reasoning",
    H_AN + H_CALL + '{"city": Paris}<|call|>',
    H_AN + H_CALL + '{"city": "Rome", "da',
    H_AN + H_CALL + '{"city": "Rome"} trailing<|call|>',
    "<|channel|>commentary to=functions.run code<|message|>print(1)<|call|>",
    '<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>'
    + H_FIN
    + "Found.",
    "<|channel|>commentary to=functions.ping<|message|><|call|>",
    "<|start|>assistant<|channel|>final\nHello",
    H_AN + "<|start|>assistant<|channel|>fin",
    H_AN + "<|channel|>final<|message|>Hi<|return|>",
    H_AN + "<|end|>stray text<|start|>assistant<|channel|>final<|message|>ok",
    "No harmony here, to=x <|",
    "<|message|>orphan body<|end|>  <|start|><|end|>",
    H_CALL + '{"city": "A"}<|call|>' + H_CALL_FIRST + '{"mode": 1}<|call|>',
    "<|channel|>analysis " + "x" * 600 + "<|message|>long header",
    "<|channel|>analysis<|message|>a<|constrain|>b<|message|>c<|channel|>final<|message|>d",
]

# Kimi K2 (parser "kimi_k2"): DeepSeek's block of calls with its own markers (special tokens).
K_SEC, K_SEC_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
K_CALL, K_ARGS, K_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
KIMI = [
    f'Let me look.{K_SEC}{K_CALL}functions.get_weather:0{K_ARGS}{{"city": "Tokyo"}}{K_END}'
    f'{K_CALL}functions.write:1{K_ARGS}{{"path": "a", "content": "日本 <| x"}}{K_END}{K_SEC_END}',
    f'{K_SEC}{K_CALL}no arguments marker{K_END}{K_CALL}g:3{K_ARGS}{{"b": 2}}{K_END}{K_SEC_END}',
    f"Text {K_SEC}not a call{K_SEC_END} after",
    f"Cut off {K_SEC}",
    f"Stray {K_SEC_END} end",
    f'{K_SEC}{K_CALL}functions.f:0{K_ARGS}{{"a": 1, "b": ',
    f"{K_CALL}functions.ping:0{K_ARGS}{K_END}",
    f'{K_CALL}functions.h:0{K_ARGS}{{"c": oops}}{K_END} tail',
    "x <|im_end|> <|tool_call",
]

# MiniMax-M2 (parser "minimax_m2"): DSML's structure, XML-like markers, values typed by schema.
MM, MM_END = "<minimax:tool_call>", "</minimax:tool_call>"
MINIMAX = [
    f'Let me check.\n{MM}\n<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n'
    f'<parameter name="days">2</parameter>\n</invoke>\n<invoke name="write">\n'
    f'<parameter name="content">if a < b:\n    x = "<p>"\n</parameter>\n'
    f'<parameter name="opts">{{"k": [1, null]}}</parameter>\n</invoke>\n{MM_END}',
    f"{MM}<invoke name='write'><parameter name='mode'>7</parameter></invoke>{MM_END} Done.",
    f'{MM}\n<invoke name="get_weather">\n{{"city": "Lima", "days": 2}}\n</invoke>\n{MM_END}',
    f'{MM}\n<invoke name="get_weather">\n<parameter name="city">Paris\n'
    f'<parameter name="days">2</parameter>\n<invoke name="b">\n{MM_END}after',
    f"Text {MM}not a call{MM_END} after",
    f'{MM}\n<invoke name="{{{{ tc.name }}}}">\n</invoke>\n{MM_END}',
    '<invoke name="a">\n<parameter name="x">1</parameter>\n</invoke> bare',
    f'{MM}<invoke name="write"><parameter name="path">a</parameter><parameter name="path">b'
    f"</parameter></invoke></invoke>\nprose{MM_END}",
    f'{MM}\n<invoke name="get_weather">\n<parameter name="city">Ber',
    "The <minimax:tool_ca",
    f'{MM}<invoke name="a"></invoke>{MM_END}\n{MM}<invoke name="b"><parameter name="x">[1]'
    f"</parameter></invoke>{MM_END}{MM_END}",
]

CORPUS = {
    "hermes": HERMES + CODER[:2],
    "qwen3_coder": CODER + HERMES[:1],
    "deepseek": DEEPSEEK,
    "dsml": DSML,
    "glm": GLM,
    "llama": LLAMA,
    "harmony": HARMONY,
    "kimi": KIMI,
    "minimax": MINIMAX,
}
FORMAT_OF = {
    "hermes": "hermes",
    "qwen25": "hermes",
    "qwen3": "hermes",
    "qwen3_coder": "qwen3_coder",
    "qwen3_xml": "qwen3_coder",
    "deepseek_v3": "deepseek",
    "deepseek_v31": "deepseek",
    "deepseek_dsml": "dsml",
    "deepseek_v32": "dsml",
    "deepseek_v4": "dsml",
    "glm45": "glm",
    "glm47": "glm",
    "llama3_json": "llama",
    "openai": "harmony",
    "kimi_k2": "kimi",
    "minimax_m2": "minimax",
}

# How the reasoning around a call may look: closed, unterminated (the call start ends it),
# pre-filled by the template (no <think> in the output), and a call start named in prose.
WRAPPERS = [
    "{}",
    "<think>Plan it.</think>\n\n{}",
    "<think>Plan it.\n{}",
    "Plan it.</think>{}",
    "Plan it. {}",
    "<think>Say <tool_call> and {}</think> ok",
    "<|channel|>analysis<|message|>Plan it.<|end|><|start|>assistant<|channel|>final<|message|>{}",
]


def test_every_parser_has_a_corpus():
    assert set(FORMAT_OF) == set(TOOL_PARSERS)


@pytest.mark.parametrize("tool", sorted(TOOL_PARSERS))
def test_tool_parsers_are_split_invariant(tool):
    for i, text in enumerate(CORPUS[FORMAT_OF[tool]]):
        check(text, tool, seed=i, splits=15, tools=TOOLS)
        check(text, tool, seed=i, splits=3)  # without schemas


@pytest.mark.parametrize("reasoning", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("started", [False, True])
def test_reasoning_parsers_are_split_invariant(reasoning, started):
    texts = [
        "<think>\nstep 1\n</think>\n\nAnswer: 4",
        "<think>cut off",
        "thinking...</think>answer <think>",
        "plain answer </think> x",
        "\n\n<think>a</think>",
        "<thi",
        "",
        "  ",
        "all reasoning </thin",
        H_AN + H_FIN + "Answer: 4<|return|>",
        "<|channel|>analysis<|message|>cut <|en",
        H_AN + "<|channel|>final\nnot a header",
    ]
    for i, text in enumerate(texts):
        check(text, None, reasoning, seed=i, splits=15, reasoning_started=started)


@pytest.mark.parametrize("tool", sorted(set(FORMAT_OF.values())))
@pytest.mark.parametrize("reasoning", sorted(REASONING_PARSERS))
def test_reasoning_and_tools_chained_are_split_invariant(tool, reasoning):
    name = next(n for n, f in sorted(FORMAT_OF.items()) if f == tool)
    rng = random.Random(f"{tool}-{reasoning}")
    for i, text in enumerate(CORPUS[tool]):
        for wrapper in WRAPPERS:
            started = rng.random() < 0.5
            check(
                wrapper.format(text),
                name,
                reasoning,
                seed=i,
                splits=4,
                tools=TOOLS,
                reasoning_started=started,
            )


@pytest.mark.parametrize("tool", sorted(set(FORMAT_OF.values())))
def test_random_mixtures_of_corpus_pieces_are_split_invariant(tool):
    # Pieces of the corpus (markers, half calls) glued at random: every parser of the format,
    # chained with each reasoning parser, still agrees across splits.
    rng = random.Random(tool)
    pieces: list[str] = []
    for text in CORPUS[tool]:
        cuts = sorted(rng.sample(range(len(text)), k=min(3, len(text))))
        pieces += [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]) if b > a]
    pieces += [
        "<think>",
        "</think>",
        "\n",
        " ",
        "x",
        "<",
        "</parameter>",
        "<parameter=city>",
        "<|python_tag|>",
        DS_CALLS,
        f"<{D}",
        f"</{D}invoke>",
        "<|start|>assistant",
        "<|channel|>analysis<|message|>",
        "<|channel|>final",
        "<|message|>",
        " to=functions.get_weather",
        "<|end|>",
        "<|call|>",
        "<|",
    ]
    if tool == "minimax":  # (only here: the other formats keep their draws)
        pieces += [MM, MM_END, '<invoke name="get_weather">', '<parameter name="city">']
    names = sorted(n for n, f in FORMAT_OF.items() if f == tool)
    for trial in range(40):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        reasoning = rng.choice([None, *sorted(REASONING_PARSERS)])
        check(
            text,
            rng.choice(names),
            reasoning,
            seed=trial,
            splits=5,
            tools=TOOLS,
            reasoning_started=rng.random() < 0.3,
        )
