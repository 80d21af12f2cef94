"""Bad input to ``resin serve`` (OpenAI endpoints): the right status and error body, every time,
and the server keeps serving — malformed requests, over-long prompts, unknown models, a full
queue, and a runner that raises or returns garbage mid-stream.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from resin import ForwardOutput
from resin.runners.scripted import CyclingRunner
from resin.server.context import ServerOptions
from resin.server.engine_loop import MAX_CONSECUTIVE_FAILED_STEPS
from resin.server.serve import build_context
from tests.server_harness import LiveServer

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3"
MODEL = "qwen3-tiny"
MESSAGES = [{"role": "user", "content": "hi"}]
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server():
    ctx = build_context(
        FIXTURE,
        runner="null",
        max_num_seqs=8,
        max_model_len=MAX_MODEL_LEN,
        options=ServerOptions(served_model_names=[MODEL]),
    )
    with LiveServer(ctx) as live:
        yield live


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BAD_REQUESTS = [
    # (path, body, status, param or None, code or None)
    (CHAT, {"model": MODEL}, 400, "messages", None),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages", None),
    (CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    (
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        400,
        "messages",
        None,
    ),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": MESSAGES,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": "abc"}}],
        },
        400,
        "tools[0].function.parameters",
        None,
    ),
    (
        CHAT,
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages",
        None,
    ),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages", None),
    (
        CHAT,
        {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
                }
            ],
        },
        400,
        "messages",
        None,
    ),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "temperature": "hot"}, 400, "temperature", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "temperature": 3}, 400, "temperature", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "top_p": 1.5}, 400, "top_p", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": "ten"}, 400, "max_tokens", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "n": 0}, 400, "n", None),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "stop": 7}, 400, "stop", None),
    (
        CHAT,
        {"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 50},
        400,
        "top_logprobs",
        None,
    ),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "tools": "all"}, 400, "tools", None),
    # refused, not silently ignored / wrongly accepted (vLLM refuses them too)
    *[
        (path, {"model": MODEL, key: value, "logit_bias": bias}, 400, "logit_bias", None)
        for path, key, value in ((CHAT, "messages", MESSAGES), (COMPLETIONS, "prompt", "hi"))
        for bias in (
            [5],
            {"five": 1},
            {"-1": 1},
            {"5": "1"},
            {"5": True},
            {"5": 100.5},
            {"5": -(10**400)},
            {"5": 1, "05": 2},
            {"99999999": 1},  # past the vocabulary: refused by the engine, the field named
        )
    ],
    (CHAT, {"model": MODEL, "messages": MESSAGES, "top_logprobs": 3}, 400, "top_logprobs", None),
    (
        CHAT,
        {"model": MODEL, "messages": MESSAGES, "tool_choice": "required"},
        400,
        "tool_choice",
        None,
    ),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "top_k": 10**12}, 400, "top_k", None),
    (
        CHAT,
        {"model": MODEL, "messages": MESSAGES, "tool_choice": "sometimes"},
        400,
        "tool_choice",
        None,
    ),
    (
        CHAT,
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 10_000},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": "word " * 400}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (CHAT, {"model": "gpt-9", "messages": MESSAGES}, 404, "model", "model_not_found"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "seed": 2**64}, 400, "seed", None),
    (
        CHAT,
        {"model": MODEL, "messages": MESSAGES, "stream_options": "x"},
        400,
        "stream_options",
        None,
    ),
    (
        CHAT,
        {"model": MODEL, "messages": MESSAGES, "chat_template": "{{ 'x' }}"},
        400,
        "chat_template",
        None,
    ),
    (COMPLETIONS, {"model": MODEL}, 400, "prompt", None),
    (COMPLETIONS, {"model": MODEL, "prompt": []}, 400, "prompt", None),
    (COMPLETIONS, {"model": MODEL, "prompt": [1, "a"]}, 400, "prompt", None),
    (COMPLETIONS, {"model": MODEL, "prompt": [[1, 2], [10**9]]}, 400, "prompt", None),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logprobs": 9}, 400, "logprobs", None),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "suffix": "!"}, 400, "suffix", None),
    (
        COMPLETIONS,
        {"model": MODEL, "prompt": list(range(5, 200))},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    (COMPLETIONS, {"model": "nope", "prompt": "hi"}, 404, "model", "model_not_found"),
]


def test_stream_must_be_a_boolean(server):
    response = httpx.post(
        f"{server.base_url}{CHAT}", json={"model": MODEL, "messages": MESSAGES, "stream": "false"}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"


def test_largest_seed_with_n_choices(server):
    response = httpx.post(
        f"{server.base_url}{CHAT}",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "seed": 2**63 - 1, "n": 3},
    )
    assert response.status_code == 200 and len(response.json()["choices"]) == 3


def test_a_negative_seed_is_an_int64_seed_like_any_other(server):
    """OpenAI and vLLM take any int64 seed; -1 is mapped to a non-negative one, deterministically."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "seed": -1, "temperature": 1}
    first = httpx.post(f"{server.base_url}{CHAT}", json=body)
    again = httpx.post(f"{server.base_url}{CHAT}", json=body)
    assert first.status_code == 200
    text = first.json()["choices"][0]["message"]["content"]
    assert text == again.json()["choices"][0]["message"]["content"]
    too_small = httpx.post(f"{server.base_url}{CHAT}", json={**body, "seed": -(2**63) - 1})
    assert too_small.status_code == 400 and too_small.json()["error"]["param"] == "seed"


@pytest.mark.parametrize(
    "path,body,status,param,code",
    BAD_REQUESTS,
    ids=[f"{p.rsplit('/', 1)[1]}-{i}" for i, (p, *_) in enumerate(BAD_REQUESTS)],
)
def test_bad_request_gets_openai_error(server, path, body, status, param, code):
    for stream in (False, True):
        response = httpx.post(f"{server.base_url}{path}", json={**body, "stream": stream})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"]
        assert error["param"] == param
        assert error["code"] == code
        if code == "context_length_exceeded":
            assert "maximum context length" in error["message"]
    ok = httpx.post(
        f"{server.base_url}{CHAT}", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", '"caf\xe9"'.encode("latin-1")])
def test_malformed_json_is_400_everywhere(server, raw):
    for path in (CHAT, COMPLETIONS, "/v1/responses"):
        response = httpx.post(
            f"{server.base_url}{path}", content=raw, headers={"content-type": "application/json"}
        )
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "invalid_request_error"
    anthropic = httpx.post(f"{server.base_url}/v1/messages", content=raw)
    assert anthropic.status_code == 400
    assert anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "invalid_request_error"


def test_unknown_fields_query_strings_and_unknown_routes(server):
    response = httpx.post(
        f"{server.base_url}{CHAT}?beta=true",
        json={
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 2,
            "store": False,
            "metadata": {"a": "b"},
            "best_of": 1,
            "repetition_penalty": 1.0,
            "logprobs": None,
            "service_tier": "auto",
            "prompt_cache_key": "k",
            "stream_options": None,
        },
    )
    assert response.status_code == 200
    missing = httpx.get(f"{server.base_url}/v1/nothing-here")
    assert missing.status_code == 404 and "error" in missing.json()


def test_sdk_raises_typed_errors(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100_000)
    assert excinfo.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=MESSAGES)


class FlakyRunner:
    """Emits ordinary tokens; raises, or returns a wrong-length output, on chosen steps."""

    def __init__(self, token_ids: list[int]) -> None:
        self.inner = CyclingRunner(token_ids)
        self.mode: str | None = None

    def forward(self, plan):
        if self.mode == "raise":
            raise RuntimeError("kernel exploded")
        if self.mode == "garbage":
            return ForwardOutput(
                token_ids=np.zeros(plan.num_sequences + 3, dtype=np.uint32),
                token_indptr=np.arange(plan.num_sequences + 1, dtype=np.uint32),
            )
        return self.inner.forward(plan)


@pytest.mark.parametrize("mode", ["raise", "garbage"])
def test_runner_failure_fails_only_its_requests_and_server_recovers(mode):
    ctx0 = build_context(FIXTURE, runner="null", max_num_seqs=4, max_model_len=MAX_MODEL_LEN)
    runner = FlakyRunner(list(ctx0.tokenizer.encode(" a b c", add_special_tokens=False)))
    ctx = build_context(
        FIXTURE,
        runner=runner,
        max_num_seqs=4,
        max_model_len=MAX_MODEL_LEN,
        options=ServerOptions(served_model_names=[MODEL]),
    )
    with LiveServer(ctx) as live:
        runner.mode = mode
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
        failed = httpx.post(f"{live.base_url}{CHAT}", json=body)
        assert failed.status_code == 500
        assert "runner failed" in failed.json()["error"]["message"]
        stream = httpx.post(f"{live.base_url}{CHAT}", json={**body, "stream": True})
        assert stream.status_code == 200
        assert '"error"' in stream.text and "[DONE]" not in stream.text
        runner.mode = None
        ok = httpx.post(f"{live.base_url}{CHAT}", json=body)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
        assert live.metric("resin:num_requests_running") == 0
        assert live.metric("resin:kv_cache_usage_perc") == 0


def test_runner_broken_for_good_turns_health_503():
    ctx0 = build_context(FIXTURE, runner="null", max_num_seqs=4, max_model_len=MAX_MODEL_LEN)
    runner = FlakyRunner(list(ctx0.tokenizer.encode(" a b c", add_special_tokens=False)))
    ctx = build_context(
        FIXTURE,
        runner=runner,
        max_num_seqs=4,
        max_model_len=MAX_MODEL_LEN,
        options=ServerOptions(served_model_names=[MODEL]),
    )
    with LiveServer(ctx) as live:
        runner.mode = "raise"
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
        statuses = [
            httpx.post(f"{live.base_url}{CHAT}", json=body).status_code
            for _ in range(MAX_CONSECUTIVE_FAILED_STEPS + 2)
        ]
        assert statuses[0] == 500 and statuses[-1] == 503
        assert httpx.get(f"{live.base_url}/health").status_code == 503


class SlowRunner(CyclingRunner):
    def forward(self, plan):
        time.sleep(0.02)
        return super().forward(plan)


def test_queue_full_is_429_with_retry_after():
    ctx0 = build_context(FIXTURE, runner="null", max_num_seqs=1, max_model_len=MAX_MODEL_LEN)
    runner = SlowRunner(list(ctx0.tokenizer.encode(" a b", add_special_tokens=False)))
    ctx = build_context(
        FIXTURE,
        runner=runner,
        max_num_seqs=1,
        max_model_len=MAX_MODEL_LEN,
        options=ServerOptions(served_model_names=[MODEL], max_queued_requests=0),
    )
    with LiveServer(ctx) as live:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 50}
        first = threading.Thread(
            target=httpx.post,
            args=(f"{live.base_url}{CHAT}",),
            kwargs={"json": body, "timeout": 30},
        )
        first.start()
        deadline = time.monotonic() + 10
        while live.metric("resin:num_requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        busy = httpx.post(f"{live.base_url}{CHAT}", json=body)
        assert busy.status_code == 429
        assert busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["type"] == "rate_limit_error"
        first.join()
        assert (
            httpx.post(f"{live.base_url}{CHAT}", json={**body, "max_tokens": 2}).status_code == 200
        )
        # More sequences than the server ever holds: a 400 not to retry (the SDKs retry 429s).
        never = httpx.post(f"{live.base_url}{CHAT}", json={**body, "n": 2})
        assert never.status_code == 400 and never.headers["x-should-retry"] == "false"
        assert "needs 2 sequences" in never.json()["error"]["message"]


def test_a_refusal_after_the_stream_started_is_still_a_400_in_stream():
    """A stream's headers go out before the engine sees the request; should the engine refuse
    it then, the in-stream error is the 400 the request would have got (its field named), not
    a server error; a runner failure stays a server_error."""
    from resin.server.engine_loop import RequestRejected
    from resin.server.errors import openai_stream_error

    refused = openai_stream_error(
        RequestRejected("SamplingParams.logit_bias: token 9 is not below")
    )
    assert refused["error"]["type"] == "invalid_request_error"
    assert refused["error"]["param"] == "logit_bias"
    failed = openai_stream_error(RuntimeError("the runner failed"))
    assert failed["error"] == {
        "message": "the runner failed",
        "type": "server_error",
        "param": None,
        "code": 500,
    }


def test_context_overflow_messages_state_what_was_asked(server):
    """A prompt that fills the context alone says so (not "0 in the completion"); one that
    leaves too little room counts the completion asked for."""
    full = httpx.post(
        f"{server.base_url}{COMPLETIONS}",
        json={"model": MODEL, "prompt": list(range(5, 5 + MAX_MODEL_LEN)), "max_tokens": 1},
    )
    message = full.json()["error"]["message"]
    assert f"your prompt has {MAX_MODEL_LEN} tokens, which leaves no room" in message
    asked = httpx.post(
        f"{server.base_url}{CHAT}",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 10_000},
    )
    message = asked.json()["error"]["message"]
    assert "in the messages, 10000 in the completion" in message
