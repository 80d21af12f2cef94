"""``resin serve --runner mlx`` on the demo checkpoint (the tiny Qwen3 fixture) answers the
official ``openai`` and ``anthropic`` SDK clients over real HTTP, and its greedy text is what
``resin.LLM(..., runner="mlx")`` produces offline for the same conversation — the server adds
transport, not behaviour. The command runs as a subprocess, exactly as a user starts it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")

import anthropic  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402

from resin import SamplingParams  # noqa: E402
from resin.llm import LLM  # noqa: E402
from tests.server_harness import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "tests" / "fixtures" / "qwen3"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "resin.cli",
                "serve",
                str(DEMO),
                "--runner",
                "mlx",
                "--port",
                str(port),
                "--served-model-name",
                "demo",
                "--max-model-len",
                "256",
                "--max-num-seqs",
                "4",
                "--log-level",
                "warning",
            ],
            cwd=REPO,
            stderr=stderr,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, f"resin serve exited: {log.read_text()}"
            assert time.monotonic() < deadline, "resin serve did not start"
            time.sleep(0.2)
        yield url, log.read_text()
    finally:
        process.terminate()
        assert process.wait(timeout=30) in (0, -15)


@pytest.fixture(scope="module")
def expected() -> str:
    llm = LLM(DEMO, runner="mlx", max_num_seqs=4, max_model_len=256)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    return llm.chat(MESSAGES, params)[0].text


def test_serves_with_the_mlx_runner(server: tuple[str, str]) -> None:
    _, stderr = server
    assert "(runner MlxRunner," in stderr


def test_openai_chat_equals_offline_mlx(server: tuple[str, str], expected: str) -> None:
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    response = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0
    )
    assert response.choices[0].message.content == expected
    assert response.usage is not None and response.usage.completion_tokens <= MAX_TOKENS
    stream = client.chat.completions.create(
        model="demo", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == expected


def test_anthropic_messages_equal_offline_mlx(server: tuple[str, str], expected: str) -> None:
    url, _ = server
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    message = client.messages.create(
        model="demo", max_tokens=MAX_TOKENS, messages=MESSAGES, extra_body={"temperature": 0.0}
    )
    text = "".join(block.text for block in message.content if block.type == "text")
    assert text == expected
    assert message.usage.output_tokens <= MAX_TOKENS
