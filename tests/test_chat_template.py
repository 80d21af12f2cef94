"""``resin.chat_template`` renders exactly what transformers' ``apply_chat_template(tokenize=False)``
renders, for real-world template styles (Llama-3, Llama-3.1 with tools, Qwen2.5 with tools, Qwen3
with ``enable_thinking``, Mistral ``[INST]`` with ``raise_exception``, ChatML, Gemma, multi-line Zephyr) across
conversations, ``add_generation_prompt``, tools, system messages and extra kwargs — and raises
the template's own message where transformers raises.

The templates are embedded below as strings (written after the public checkpoints'
``tokenizer_config.json``); each is saved with a tiny tokenizer into a temporary checkpoint that
both Resin and ``transformers.AutoTokenizer`` load.
"""

from __future__ import annotations

import copy
import datetime
import json
from pathlib import Path
from typing import Any

import jinja2  # noqa: E402,F401  (a runtime dependency: fail loudly if missing)
import pytest
from test_tokenizer import hf_tokenizer, write_checkpoint

from resin.chat_template import ChatTemplate, ChatTemplateError

# Real-world template styles, one file each (verbatim Jinja as the checkpoints ship it).
TEMPLATE_DIR = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
TEMPLATES = {
    name: (TEMPLATE_DIR / f"{name}.jinja").read_text()
    for name in [
        "llama3",
        "llama31",
        "qwen25",
        "qwen3",
        "mistral",
        "chatml",
        "gemma",
        "zephyr",
        "features",
    ]
}
LLAMA3, QWEN25, CHATML, GEMMA, FEATURES = (
    TEMPLATES[n] for n in ("llama3", "qwen25", "chatml", "gemma", "features")
)
SPECIALS = {
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "llama31": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "qwen25": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "qwen3": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>"},
    "chatml": {"eos_token": "<|im_end|>"},
    "gemma": {"bos_token": "<s>", "eos_token": "<end_of_turn>"},
    "zephyr": {"eos_token": "</s>"},
    "features": {"bos_token": "<s>", "eos_token": "</s>", "image_token": "<|image|>"},
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle — température en °C",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {
                "city": {"type": "string", "description": "Ville, e.g. Zürich or 東京"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
        },
    },
}
CALL = {
    "type": "function",
    "id": "call_1",
    "function": {"name": "get_weather", "arguments": {"city": "東京", "unit": "celsius"}},
}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single_user": [{"role": "user", "content": "Hello! 😀"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are terse.  "},
        {"role": "user", "content": "  What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": 'And 3+3? «quoted» "json" </s>'},
    ],
    "multi_turn": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
    ],
    "tool_round_trip": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Tokyo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
        {"role": "assistant", "content": "It is 21 °C."},
        {"role": "user", "content": "Thanks"},
    ],
    "reasoning": [
        {"role": "user", "content": "Solve x+1=2"},
        {"role": "assistant", "reasoning_content": "subtract one", "content": "x = 1"},
        {"role": "user", "content": "Now x+2=5"},
        {"role": "assistant", "content": "<think>\nthree\n</think>\n\nx = 3"},
    ],
    "bad_role_order": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
}
KWARG_SETS: list[dict[str, Any]] = [
    {},
    {"enable_thinking": False},
    {"enable_thinking": True},
    {"date_string": "01 Jan 2025", "tools_in_user_message": False},
]

_DIRS: dict[str, Path] = {}
_HF: dict[str, Any] = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat_templates")
    for name, template in TEMPLATES.items():
        _DIRS[name] = write_checkpoint(root / name, {**SPECIALS[name], "chat_template": template})
    return _DIRS


def render_both(directory: Path, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, str]:
    """(Resin's rendering, transformers' rendering); when transformers raises, Resin must raise
    the same message and the pair is ("raised: <message>", same)."""
    key = str(directory)
    if key not in _HF:
        _HF[key] = hf_tokenizer(directory)
    try:
        theirs = _HF[key].apply_chat_template(copy.deepcopy(messages), tokenize=False, **kwargs)
    except jinja2.exceptions.TemplateError as exc:
        with pytest.raises(ChatTemplateError) as ours_exc:
            ChatTemplate.from_pretrained(directory).render(copy.deepcopy(messages), **kwargs)
        return f"raised: {ours_exc.value}", f"raised: {exc.message}"
    ours = ChatTemplate.from_pretrained(directory).render(copy.deepcopy(messages), **kwargs)
    return ours, theirs


@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [False, True])
def test_render_matches_transformers(
    checkpoints: dict[str, Path],
    template: str,
    conversation: str,
    add_generation_prompt: bool,
    with_tools: bool,
) -> None:
    tools = [WEATHER_TOOL] if with_tools else None
    for kwargs in KWARG_SETS:
        ours, theirs = render_both(
            checkpoints[template],
            CONVERSATIONS[conversation],
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **kwargs,
        )
        assert ours == theirs, kwargs


def test_the_grid_covers_the_interesting_branches(checkpoints: dict[str, Path]) -> None:
    """Guards against a vacuous grid: the branches the templates exist for really render."""
    chat = CONVERSATIONS["tool_round_trip"]
    llama = ChatTemplate.from_pretrained(checkpoints["llama31"]).render(chat, tools=[WEATHER_TOOL])
    assert '"name": "get_weather"' in llama and "Environment: ipython" in llama
    assert '"{\\"temp_c\\": 21}"' in llama  # the tool content is a string, tojson'd: a known quirk
    qwen3 = ChatTemplate.from_pretrained(checkpoints["qwen3"])
    off = qwen3.render(
        CONVERSATIONS["single_user"], add_generation_prompt=True, enable_thinking=False
    )
    assert off.endswith("<think>\n\n</think>\n\n")
    assert "<think>\nthree\n</think>" in qwen3.render(CONVERSATIONS["reasoning"])
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate.from_pretrained(checkpoints["mistral"]).render(CONVERSATIONS["bad_role_order"])
    features = ChatTemplate.from_pretrained(checkpoints["features"]).render(
        CONVERSATIONS["single_user"], tools=[WEATHER_TOOL]
    )
    assert f"date={datetime.date.today():%Y-%m-%d} image=<|image|> eos=</s>" in features
    assert "\\u00e9" in features and '"Hello! 😀"' in features  # ensure_ascii only where asked


def test_documents_and_continue_final_message(checkpoints: dict[str, Path]) -> None:
    documents = [{"title": "Doc A", "text": "alpha"}, {"title": "Doc B", "text": "beta"}]
    ours, theirs = render_both(
        checkpoints["features"],
        CONVERSATIONS["multi_turn"],
        documents=documents,
        add_generation_prompt=True,
    )
    assert ours == theirs and "[doc 2] Doc B: beta" in ours
    prefill = CONVERSATIONS["multi_turn"] + [{"role": "assistant", "content": "Sure, here  "}]
    for name in ("chatml", "qwen25", "llama3", "gemma"):
        ours, theirs = render_both(checkpoints[name], prefill, continue_final_message=True)
        assert ours == theirs and ours.rstrip().endswith("Sure, here"), name
    with pytest.raises(ValueError, match="not compatible"):
        ChatTemplate(CHATML).render(
            prefill, continue_final_message=True, add_generation_prompt=True
        )


def test_named_templates_and_template_files(tmp_path: Path) -> None:
    named = [
        {"name": "default", "template": CHATML},
        {"name": "tool_use", "template": QWEN25},
        {"name": "rag", "template": FEATURES},
    ]
    directory = write_checkpoint(tmp_path / "named", {**SPECIALS["qwen25"], "chat_template": named})
    chat = CONVERSATIONS["multi_turn"]
    for kwargs in (
        {},
        {"tools": [WEATHER_TOOL]},
        {"chat_template": "rag"},
        {"chat_template": LLAMA3},
    ):
        ours, theirs = render_both(directory, chat, add_generation_prompt=True, **kwargs)
        assert ours == theirs, kwargs
    assert ChatTemplate.from_pretrained(directory).names == ["default", "rag", "tool_use"]
    # chat_template.jinja wins over tokenizer_config.json, as in transformers.
    (directory / "chat_template.jinja").write_text(GEMMA, encoding="utf-8")
    _HF.pop(str(directory))  # reload transformers' tokenizer to see the new file
    ours, theirs = render_both(directory, chat, add_generation_prompt=True)
    assert ours == theirs and "<start_of_turn>model\n" in ours


def test_rich_message_objects_and_none_fields() -> None:
    """Message keys set to None are dropped; dataclass messages render like dicts."""
    import dataclasses

    @dataclasses.dataclass
    class Message:
        role: str
        content: str | None = None

    template = ChatTemplate(
        "{% for m in messages %}{{ m.role }}:{{ m.content is defined }};{% endfor %}"
    )
    as_objects = template.render([Message("user", "hi"), Message("assistant")])
    assert as_objects == "user:True;assistant:False;"
    assert as_objects == template.render(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    )


def test_clear_errors(tmp_path: Path) -> None:
    directory = write_checkpoint(tmp_path / "none", {"eos_token": "</s>"})
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.from_pretrained(directory).render(CONVERSATIONS["single_user"])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}").render(CONVERSATIONS["single_user"])
    with pytest.raises(ValueError, match="empty conversation"):
        ChatTemplate(CHATML).render([])
    with pytest.raises(TypeError, match="JSON-schema dicts"):
        ChatTemplate(CHATML).render(CONVERSATIONS["single_user"], tools=[len])
    with pytest.raises(ChatTemplateError, match="no default"):
        ChatTemplate({"a": CHATML, "b": GEMMA}).render(CONVERSATIONS["single_user"])
    with pytest.raises(ChatTemplateError, match="underscore-prefixed"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render(CONVERSATIONS["single_user"])
    with pytest.raises(ChatTemplateError, match="unsafe|not safely|access"):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render(
            CONVERSATIONS["single_user"]
        )


def test_import_resin_does_not_load_these_modules() -> None:
    import subprocess
    import sys

    code = (
        "import resin, sys, json; print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('transformers', 'torch', 'tokenizers', 'jinja2') "
        "or m in ('resin.tokenizer', 'resin.chat_template'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == []
    code = (
        "import resin.tokenizer, resin.chat_template, sys; "
        "print(any(m.split('.')[0] in ('transformers', 'torch') for m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
