"""``resin serve`` on the tiny GLM-5.3-Flash checkpoint (resin/models/glm5_flash/tiny): the
checkpoint's defaults (model_type ``glm5_next``: the ``glm47`` tool parser, ``glm45`` reasoning,
no flags) parse a GLM tool call — ``<tool_call>`` with ``<arg_key>`` / ``<arg_value>`` after
reasoning and text — into OpenAI ``tool_calls`` and Anthropic ``tool_use``, streamed and not (a
scripted runner emits the exact text through the checkpoint's own tokenizer); a request with an
image gets a 400 (the model is served text-only).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from resin.runners.scripted import ScriptedRunner  # noqa: E402
from resin.server.context import ServerOptions  # noqa: E402
from resin.server.serve import build_context  # noqa: E402
from resin.tokenizer import Tokenizer  # noqa: E402
from tests.server_harness import LiveServer  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "resin" / "models" / "glm5_flash" / "tiny"
MODEL = "glm5-tiny"
TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
GLM_CALL = (
    "<think>Oslo, two days.</think>Checking.<tool_call>get_weather"
    "<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
    "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
)
MESSAGES = [{"role": "user", "content": "Weather in Oslo for two days?"}]


@pytest.fixture(scope="module")
def scripted():  # type: ignore[no-untyped-def]
    tokenizer = Tokenizer.from_pretrained(TINY)
    ids = tokenizer.encode(GLM_CALL, add_special_tokens=False)
    assert len(ids) > len(GLM_CALL) // 8, "markers should span several tokens"
    runner = ScriptedRunner(ids, tokenizer.eos_token_id)
    ctx = build_context(
        TINY,
        runner=runner,
        options=ServerOptions(served_model_names=[MODEL]),
        max_num_seqs=2,
        max_model_len=4096,
    )
    with LiveServer(ctx) as live:
        yield live


def test_glm_tool_call_through_openai_streamed_and_not(scripted) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=f"{scripted.base_url}/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "function": TOOL}]
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=tools, max_tokens=300, temperature=0)
    response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content or "").strip() == "Checking."
    assert (choice.message.model_extra or {}).get("reasoning", "").strip() == "Oslo, two days."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}
    content, arguments, names, finish = "", "", [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.function.name:
                    names.append(tc.function.name)
                arguments += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert content.strip() == "Checking." and "tool_call" not in content and "arg_" not in content
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Oslo", "days": 2}
    assert finish == "tool_calls"


def test_glm_tool_call_through_anthropic_streamed_and_not(scripted) -> None:  # type: ignore[no-untyped-def]
    client = anthropic.Anthropic(base_url=scripted.base_url, api_key="x", max_retries=0)
    tools = [
        {
            "name": TOOL["name"],
            "description": TOOL["description"],
            "input_schema": TOOL["parameters"],
        }
    ]
    kwargs = dict(model=MODEL, max_tokens=300, messages=MESSAGES, tools=tools)
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    kinds = [block.type for block in message.content]
    assert kinds == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking.strip() == "Oslo, two days."
    assert message.content[1].text.strip() == "Checking."
    use = message.content[2]
    assert (use.name, use.input) == ("get_weather", {"city": "Oslo", "days": 2})
    with client.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in events or "content_block_delta" in events
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in final.content][2] == (
        "tool_use",
        {"city": "Oslo", "days": 2},
    )


def test_an_image_request_is_refused_with_a_400(scripted) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=f"{scripted.base_url}/v1", api_key="x", max_retries=0)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError, match="accepts text only"):
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}
            ],
            max_tokens=4,
        )
