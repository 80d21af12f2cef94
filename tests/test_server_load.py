"""Load on ``resin serve``: 200 concurrent SDK streams complete exactly; 50 clients that hang up
mid-stream are aborted at once and the cache returns to idle.

The runner is a :class:`CyclingRunner` (no model compute), so every stream's exact text is
known in advance: the cycle's tokens, decoded. For the disconnect phase each step sleeps, so a
request that were *not* aborted would still be running long after its client left.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from resin.registry import NULL_RUNNER_TEXT
from resin.runners.scripted import CyclingRunner
from resin.server.context import ServerOptions
from resin.server.serve import build_context
from resin.tokenizer import Tokenizer
from tests.server_harness import LiveServer

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3"
MODEL = "qwen3-tiny"
NUM_STREAMS = 200
NUM_DISCONNECTS = 50
MAX_TOKENS = 24


class SleepyCyclingRunner(CyclingRunner):
    step_sleep_s = 0.0

    def forward(self, plan):
        if self.step_sleep_s:
            time.sleep(self.step_sleep_s)
        return super().forward(plan)


@pytest.fixture(scope="module")
def setup():
    tokenizer = Tokenizer.from_pretrained(FIXTURE)
    cycle = tokenizer.encode(NULL_RUNNER_TEXT, add_special_tokens=False)
    runner = SleepyCyclingRunner(cycle)
    ctx = build_context(
        FIXTURE,
        runner=runner,
        max_num_seqs=256,
        max_model_len=1024,
        options=ServerOptions(served_model_names=[MODEL]),
    )

    def expected(num_prompt_tokens: int) -> str:
        """The null runner's text: output j is cycle[(prompt length + j) % len(cycle)]."""
        return tokenizer.decode(
            [cycle[(num_prompt_tokens + j) % len(cycle)] for j in range(MAX_TOKENS)],
            skip_special_tokens=True,
        )

    with LiveServer(ctx, backlog=4096) as live:
        yield live, runner, expected


async def _one_stream(client: openai.AsyncOpenAI, index: int) -> tuple[str, int, int, str | None]:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"request {index}"}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, usage, num_prompt, finish = "", 0, 0, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
            num_prompt = chunk.usage.prompt_tokens
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, usage, num_prompt, finish


def test_200_concurrent_streams_complete_untruncated(setup):
    live, _, expected = setup

    async def main() -> list[tuple[str, int, int, str | None]]:
        async with openai.AsyncOpenAI(
            base_url=f"{live.base_url}/v1", api_key="x", max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(_one_stream(client, i) for i in range(NUM_STREAMS)))

    results = asyncio.run(main())
    assert len(results) == NUM_STREAMS
    assert len({num_prompt for _, _, num_prompt, _ in results}) > 1  # several prompt lengths
    for text, usage, num_prompt, finish in results:
        assert text == expected(num_prompt)
        assert usage == MAX_TOKENS
        assert finish == "length"


def test_disconnects_abort_and_free_the_cache(setup):
    live, runner, _ = setup
    idle_usage = live.metric("resin:kv_cache_usage_perc")
    aborted_before = live.metric('resin:request_success_total{finished_reason="abort"}')
    runner.step_sleep_s = 0.01  # 900 tokens would take 9 s if nobody aborted them

    async def hang_up(client: httpx.AsyncClient, index: int) -> int:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"leaver {index}"}],
            "max_tokens": 900,
            "stream": True,
            "ignore_eos": True,
        }
        chunks = 0
        async with client.stream(
            "POST", f"{live.base_url}/v1/chat/completions", json=body
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                if chunks >= 3:
                    break  # leaving the block closes the connection mid-stream
        return chunks

    async def main() -> list[int]:
        async with httpx.AsyncClient(
            timeout=60, limits=httpx.Limits(max_connections=NUM_DISCONNECTS)
        ) as client:
            return await asyncio.gather(*(hang_up(client, i) for i in range(NUM_DISCONNECTS)))

    try:
        assert asyncio.run(main()) == [3] * NUM_DISCONNECTS
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if (
                live.metric("resin:num_requests_running") == 0
                and live.metric("resin:num_requests_waiting") == 0
            ):
                break
            time.sleep(0.05)
    finally:
        runner.step_sleep_s = 0.0
    assert live.metric("resin:num_requests_running") == 0
    assert live.metric("resin:num_requests_waiting") == 0
    assert live.metric("resin:kv_cache_usage_perc") == idle_usage
    aborted = live.metric('resin:request_success_total{finished_reason="abort"}') - aborted_before
    assert aborted == NUM_DISCONNECTS
    assert live.ctx.loop.num_active_requests == 0


def test_client_that_hangs_up_at_once_is_aborted_too(setup):
    """A client that sends a streaming request and closes the socket without reading a byte
    must not leave its request running to max_tokens."""
    live, runner, _ = setup
    aborted_before = live.metric('resin:request_success_total{finished_reason="abort"}')
    runner.step_sleep_s = 0.01
    try:
        for index in range(5):
            body = json.dumps(
                {
                    "model": MODEL,
                    "max_tokens": 900,
                    "stream": True,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"gone {index}"}],
                }
            ).encode()
            with socket.create_connection(("127.0.0.1", live.port)) as sock:
                sock.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\nContent-Length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            aborted = live.metric('resin:request_success_total{finished_reason="abort"}')
            if aborted - aborted_before == 5 and live.metric("resin:num_requests_running") == 0:
                break
            time.sleep(0.05)
    finally:
        runner.step_sleep_s = 0.0
    assert live.metric('resin:request_success_total{finished_reason="abort"}') - aborted_before == 5
    assert live.metric("resin:num_requests_running") == 0
    assert live.ctx.loop.num_active_requests == 0


def test_non_streaming_client_that_hangs_up_is_aborted(setup):
    """A non-streaming request whose client leaves is cancelled, not run to max_tokens."""
    live, runner, _ = setup
    aborted_before = live.metric('resin:request_success_total{finished_reason="abort"}')
    runner.step_sleep_s = 0.01
    try:
        body = json.dumps(
            {
                "model": MODEL,
                "max_tokens": 900,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "patience"}],
            }
        ).encode()
        with socket.create_connection(("127.0.0.1", live.port)) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            deadline = time.monotonic() + 5
            while live.metric("resin:num_requests_running") < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        deadline = time.monotonic() + 3.0  # 900 steps of 10 ms would take 9 s
        while time.monotonic() < deadline and live.metric("resin:num_requests_running") > 0:
            time.sleep(0.05)
    finally:
        runner.step_sleep_s = 0.0
    assert live.metric("resin:num_requests_running") == 0
    assert live.metric('resin:request_success_total{finished_reason="abort"}') == aborted_before + 1
