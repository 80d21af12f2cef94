"""``resin serve`` on the tiny GLM-5.3-Flash checkpoint (resin/models/glm5_flash/tiny): the
checkpoint's defaults (model_type ``glm5_next``: the ``glm47`` tool parser, ``glm45`` reasoning,
no flags) parse a GLM tool call — ``<tool_call>`` with ``<arg_key>`` / ``<arg_value>`` after
reasoning and text — into OpenAI ``tool_calls`` and Anthropic ``tool_use``, streamed and not (a
scripted runner emits the exact text through the checkpoint's own tokenizer); a request with an
image gets a 400 (the model is served text-only). The checkpoint's GLM-5.3-Flash template ends
the prompt with ``<|assistant|><think>``: the model's text starts inside the reasoning and
closes it with ``</think>`` (tests/test_glm5_flash_chat.py checks the template itself).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from tests.scripted_tool_calls import check_anthropic, check_openai, scripted_server  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "resin" / "models" / "glm5_flash" / "tiny"
MODEL = "glm5-tiny"
GLM_CALL = (  # what follows the template's pre-filled <think>
    "Oslo, two days.</think>Checking.<tool_call>get_weather"
    "<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
    "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
)


@pytest.fixture(scope="module")
def scripted():  # type: ignore[no-untyped-def]
    with scripted_server(TINY, GLM_CALL, MODEL) as live:
        yield live


def test_glm_tool_call_through_openai_streamed_and_not(scripted) -> None:  # type: ignore[no-untyped-def]
    check_openai(scripted, MODEL, ("tool_call", "arg_key", "arg_value"))


def test_glm_tool_call_through_anthropic_streamed_and_not(scripted) -> None:  # type: ignore[no-untyped-def]
    check_anthropic(scripted, MODEL)


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
