"""``resin serve`` on the tiny DeepSeek-V4 checkpoint (resin/models/deepseek_v4_flash/tiny).

- The registry picks the model directory's runner: OpenAI chat and Anthropic messages answer on
  the real runner (random weights: the text is whatever greedy decoding gives, equal to
  ``resin.LLM``'s for the same prompt — the DeepSeek-V4 prompt encoder on both sides, thinking
  off here so the text is content).
- A DSML tool call — what DeepSeek-V4 emits — is parsed by the checkpoint's defaults (model_type
  ``deepseek_v4``: the ``deepseek_v4`` tool and reasoning parsers, no flags) into OpenAI
  ``tool_calls`` and Anthropic ``tool_use`` blocks, streamed and not: a scripted runner makes the
  "model" emit the exact text through the checkpoint's own tokenizer (the markers span several
  tokens, as a real model's output is split across steps).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from resin.server.context import ServerOptions  # noqa: E402
from resin.server.serve import build_context  # noqa: E402
from tests.scripted_tool_calls import (  # noqa: E402
    MESSAGES,
    check_anthropic,
    check_openai,
    scripted_server,
)
from tests.server_harness import LiveServer  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "resin" / "models" / "deepseek_v4_flash" / "tiny"
MODEL = "deepseek-v4-tiny"
# Thinking mode (the encoder's default: the prompt ends with <think>): reasoning, then text,
# then the call.
DSML = (
    "Oslo, two days.</think>Checking.\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_real_runner_answers_openai_and_anthropic() -> None:
    from resin import SamplingParams
    from resin.llm import LLM

    ctx = build_context(
        TINY, options=ServerOptions(served_model_names=[MODEL]), max_num_seqs=2, max_model_len=256
    )
    assert type(ctx.loop.runner).__name__ == "ModelDirRunner"
    expected = LLM(TINY, max_num_seqs=2, max_model_len=256).chat(
        MESSAGES,
        SamplingParams(max_tokens=6, temperature=0.0),
        thinking=False,
    )[0]
    with LiveServer(ctx) as live:
        client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            extra_body={"chat_template_kwargs": {"thinking": False}},
        )
        assert chat.usage.completion_tokens == len(expected.token_ids)
        assert chat.choices[0].message.content == expected.text
        claude = anthropic.Anthropic(base_url=live.base_url, api_key="x", max_retries=0)
        # Greedy, as the OpenAI request: Anthropic's default temperature is 1, and an unseeded
        # draw that hit EOS within 6 tokens made this test flaky (this SDK has no temperature
        # argument).
        message = claude.messages.create(
            model=MODEL,
            max_tokens=6,
            messages=MESSAGES,
            thinking={"type": "disabled"},
            extra_body={"temperature": 0},
        )
        assert message.usage.output_tokens == len(expected.token_ids)
        assert message.content[0].text == expected.text  # type: ignore[union-attr]
        assert message.stop_reason in ("max_tokens", "end_turn")


@pytest.fixture(scope="module")
def scripted():  # type: ignore[no-untyped-def]
    with scripted_server(TINY, DSML, MODEL) as live:
        yield live


def test_dsml_tool_call_through_openai_streamed_and_not(scripted) -> None:  # type: ignore[no-untyped-def]
    check_openai(scripted, MODEL, ("DSML", "invoke", "parameter"))


def test_dsml_tool_call_through_anthropic_streamed_and_not(scripted) -> None:  # type: ignore[no-untyped-def]
    check_anthropic(scripted, MODEL)
