"""``resin serve`` through the official ``openai`` SDK: chat, completions, models, auth, metrics.

A live server (uvicorn, real HTTP) runs the torch reference runner on the tiny Qwen3 fixture;
its greedy outputs must equal ``resin.LLM`` on the same prompts — the server adds transport,
not behaviour. The raw-HTTP tests check the wire format the SDKs and the serving benchmarks
depend on (``data:`` lines only, the usage chunk only when asked, ``[DONE]``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from resin import SamplingParams
from resin.llm import LLM
from resin.server.context import ServerOptions
from resin.server.serve import build_context
from tests.metrics_text import parse_metrics
from tests.server_harness import LiveServer

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3"
MODEL = "qwen3-tiny"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


@pytest.fixture(scope="module")
def server():
    ctx = build_context(
        FIXTURE,
        runner="torch",
        options=ServerOptions(served_model_names=[MODEL]),
        max_num_seqs=8,
        max_model_len=256,
    )
    with LiveServer(ctx) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm():
    return LLM(FIXTURE, max_num_seqs=8, max_model_len=256)


def test_chat_greedy_equals_offline_llm(client, llm):
    expected = llm.chat(MESSAGES, SamplingParams(max_tokens=12, temperature=0.0))[0]
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    )
    choice = response.choices[0]
    assert choice.message.content == expected.text
    assert choice.message.role == "assistant"
    assert choice.finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + len(expected.token_ids)
    assert response.model == MODEL


def test_chat_stream_matches_non_stream_and_counts_usage(client):
    plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    # the same prompt again is served from the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert len({c.id for c in chunks}) == 1


def test_stream_wire_format(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event  # no event: or comment lines
        chunk = json.loads(event[len("data: ") :])
        assert chunk["choices"], "no usage chunk without stream_options.include_usage"
        assert "usage" not in chunk


def test_completions_token_id_prompts_equal_offline_llm(client, llm):
    prompts = [[5, 17, 42, 99, 7], [120, 3, 64]]
    expected = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == [e.text for e in expected]
    assert response.usage.prompt_tokens == 8
    assert response.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    streamed = client.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected[0].text


def test_completions_string_prompt_default_max_tokens_and_echo(client, llm):
    expected = llm.generate("The sky is", SamplingParams(max_tokens=16, temperature=0.0))[0]
    response = client.completions.create(model=MODEL, prompt="The sky is", temperature=0, echo=True)
    assert response.choices[0].text == "The sky is" + expected.text
    assert response.usage.completion_tokens == len(expected.token_ids) <= 16


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_does(client, llm):
    """lm-evaluation-harness scores a continuation with echo + logprobs (max_tokens 1, or 0:
    the prompt alone) over token ids and sums token_logprobs[ctxlen:-1]: every prompt token
    after the first has its logprob given the tokens before it, the first a null."""
    ids = llm.tokenizer.encode("The sky is blue and the grass is green", add_special_tokens=False)
    offline = llm.generate(
        [ids], SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1)
    )[0]
    scored = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    choice = scored.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(offline.prompt_logprobs[i][ids[i]], abs=1e-5)
        assert len(lp.top_logprobs[i]) == 1
    assert lp.token_logprobs[-1] == pytest.approx(offline.logprobs[0][offline.token_ids[0]])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert choice.text.startswith(llm.tokenizer.decode(ids))
    assert scored.usage.completion_tokens == 1
    # max_tokens 0: the prompt alone, nothing generated, the same prompt logprobs.
    only = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=0, temperature=0, logprobs=1, echo=True
    )
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    assert only.choices[0].text == llm.tokenizer.decode(ids)
    assert (only.usage.completion_tokens, only.choices[0].finish_reason) == (0, "length")
    # Streamed: the same entries, the prompt's in the first chunk.
    stream = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True, stream=True
    )
    streamed = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [x for part in streamed for x in part.token_logprobs] == lp.token_logprobs
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=ids, max_tokens=0)


def test_n_gives_distinct_indexed_choices(client):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7, n=3
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert 3 <= response.usage.completion_tokens <= 24
    assert len({c.message.content for c in response.choices}) > 1
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=7, n=3, stream=True
    )
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in response.choices]


def test_stop_string_truncates_and_seeded_sampling_repeats(client):
    base = (
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0)
        .choices[0]
        .message.content
    )
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    assert stop and stop in base
    cut = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].message.content == base[: base.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        == base[: base.index(stop)]
    )
    one = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=1.0,
        seed=123,
        top_p=0.9,
        extra_body={"top_k": 20, "min_p": 0.01},
    )
    two = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=1.0,
        seed=123,
        top_p=0.9,
        extra_body={"top_k": 20, "min_p": 0.01},
    )
    assert one.choices[0].message.content == two.choices[0].message.content


def test_logit_bias_forces_and_bans_tokens(client):
    """OpenAI's ``logit_bias`` through the SDK, chat and completions, streamed and not: +100
    forces a token the model would not pick; -100 bans the greedy choice. Logprobs stay the
    model's (of the raw logits: vLLM's default)."""
    plain = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=4, temperature=0, logprobs=1
    ).choices[0]
    forced_token = 42  # an ordinary token id in the tiny vocabulary
    forced = client.completions.create(
        model=MODEL,
        prompt="hi",
        max_tokens=4,
        temperature=0.7,
        logit_bias={str(forced_token): 100},
        logprobs=1,
        extra_body={"return_token_ids": True},
    ).choices[0]
    assert forced.token_ids == [forced_token] * 4
    assert forced.logprobs.token_logprobs[0] < plain.logprobs.token_logprobs[0]
    banned_first = (
        client.completions.create(
            model=MODEL,
            prompt="hi",
            max_tokens=1,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        .choices[0]
        .token_ids[0]
    )
    chat_plain = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0
    )
    for stream in (False, True):
        kwargs = dict(model=MODEL, prompt="hi", max_tokens=3, temperature=0, stream=stream)
        got = client.completions.create(
            **kwargs, logit_bias={str(banned_first): -100}, extra_body={"return_token_ids": True}
        )
        chunks = list(got) if stream else [got]
        ids = [t for c in chunks for choice in c.choices for t in (choice.token_ids or [])]
        assert ids and ids[0] != banned_first
        chat = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
            stream=stream,
            logit_bias={str(forced_token): 100},
        )
        text = (
            "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
            if stream
            else chat.choices[0].message.content
        )
        assert text != chat_plain.choices[0].message.content


def test_logprobs_shape_and_greedy_top1(client):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = response.choices[0].logprobs.content
    assert len(entries) == response.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))
        assert entry.logprob <= 0.0


def test_streamed_logprobs_cover_held_back_tokens(client):
    """Tokens whose text is held back (a possible stop string) still report their logprobs."""
    base = (
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
        .choices[0]
        .message.content
    )
    stop = base[-3:] + "\u2603"  # a prefix of it is held back at the end, never matched
    plain = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        stop=[stop],
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        stop=[stop],
        stream=True,
    )
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in plain.choices[0].logprobs.content]
    assert len(streamed) == plain.usage.completion_tokens


def test_ignore_eos_and_max_completion_tokens(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_completion_tokens=30,
        extra_body={"ignore_eos": True},
    )
    assert response.usage.completion_tokens == 30
    assert response.choices[0].finish_reason == "length"


def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{server.base_url}/v1/models?client_version=0.99").status_code == 200
    assert httpx.get(f"{server.base_url}/health").json() == {}
    assert "version" in httpx.get(f"{server.base_url}/version").json()
    anthropic_shape = httpx.get(
        f"{server.base_url}/v1/models", headers={"anthropic-version": "2023-06-01"}
    ).json()
    assert anthropic_shape["data"][0]["type"] == "model" and anthropic_shape["has_more"] is False


def test_models_retrieve_with_both_sdks(server, client):
    """``GET /v1/models/{id}``: each SDK's ``models.retrieve`` gets its own shape, and a
    name not served is each SDK's NotFoundError (the body in its API's error shape)."""
    assert client.models.retrieve(MODEL).model_dump()["id"] == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
    info = claude.models.retrieve(MODEL)
    assert (info.type, info.id, info.display_name) == ("model", MODEL, MODEL)
    # /v1/messages takes any claude-* name (Claude Code's), so its lookup does too
    assert claude.models.retrieve("claude-sonnet-4-5").id == "claude-sonnet-4-5"
    with pytest.raises(anthropic.NotFoundError) as gone:
        claude.models.retrieve("gpt-nothing")
    assert gone.value.body["error"]["type"] == "not_found_error"


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed"
)
def test_metrics_pass_promtool_and_count_http_requests(server, client):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    text = httpx.get(f"{server.base_url}/metrics").text
    parse_metrics(text)
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False
    )
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert [c for c in complaints if "metric names should not contain ':'" not in c] == []
    assert (
        'resin:http_requests_total{endpoint="/v1/chat/completions",method="POST",'
        'status="200"}' in text
    )
    assert server.metric("resin:generation_tokens_total") > 0


def test_api_key_required_when_configured():
    ctx = build_context(
        FIXTURE,
        runner="null",
        max_num_seqs=4,
        max_model_len=128,
        options=ServerOptions(served_model_names=[MODEL], api_key="sekret"),
    )
    with LiveServer(ctx) as live:
        url = f"{live.base_url}/v1/chat/completions"
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
        assert httpx.post(url, json=body).status_code == 401
        assert httpx.post(url, json=body, headers={"x-api-key": "wrong"}).status_code == 401
        assert httpx.post(url, json=body, headers={"x-api-key": "sekret"}).status_code == 200
        assert (
            httpx.post(url, json=body, headers={"Authorization": "Bearer sekret"}).status_code
            == 200
        )
        assert httpx.get(f"{live.base_url}/health").status_code == 200  # probes stay open
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=f"{live.base_url}/v1", api_key="nope", max_retries=0
            ).models.list()
        anthropic_401 = httpx.post(f"{live.base_url}/v1/messages", json={})
        assert anthropic_401.status_code == 401
        assert anthropic_401.json()["error"]["type"] == "authentication_error"


def test_reasoning_effort_reaches_the_template(client):
    from resin.server.openai.chat import chat_template_kwargs

    assert chat_template_kwargs({"reasoning_effort": "high"}) == {"reasoning_effort": "high"}
    assert chat_template_kwargs({"reasoning_effort": "none"}) == {
        "reasoning_effort": "none",
        "enable_thinking": False,
    }
    # vLLM's chat_template_kwargs win over the top-level field.
    assert chat_template_kwargs(
        {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}
    ) == {"reasoning_effort": "none", "enable_thinking": True}
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"reasoning_effort": 3}
        )


def test_browsers_may_call_the_api_cors(server):
    """CORS as vLLM / SGLang default it: any origin; a preflight is answered (no key needed
    for it), and responses carry Access-Control-Allow-Origin."""
    origin = {"origin": "https://app.example"}
    preflight = httpx.options(
        f"{server.base_url}/v1/chat/completions",
        headers={
            **origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    listed = httpx.get(f"{server.base_url}/v1/models", headers=origin)
    assert listed.headers["access-control-allow-origin"] == "*"


def test_the_sdks_stream_helper_accumulates_every_choice_exactly(client):
    """Each choice opens with a role-only chunk, as OpenAI and vLLM send it: the SDK's
    ``chat.completions.stream`` accumulator counted a choice's first logprobs twice when its
    role came with its first token (every choice but the first to arrive)."""
    kw: dict[str, Any] = dict(
        model=MODEL,
        messages=MESSAGES,
        n=3,
        max_tokens=8,
        logprobs=True,
        top_logprobs=1,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        snapshot = stream.current_completion_snapshot
    plain = client.chat.completions.create(**kw)
    for streamed, whole in zip(snapshot.choices, plain.choices):
        assert [t.token for t in streamed.logprobs.content] == [
            t.token for t in whole.logprobs.content
        ]
        assert len(whole.logprobs.content) == 8
        assert streamed.message.content == whole.message.content


def test_tokenize_and_detokenize_as_vllm_spells_them(server, llm):
    """vLLM's /tokenize (a prompt, or chat messages through the template) and /detokenize."""
    base = server.base_url
    text = "The sky is blue"
    plain = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert plain["tokens"] == llm.tokenizer.encode(text)
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == 256
    assert plain["token_strs"] is None
    bare = httpx.post(
        f"{base}/tokenize",
        json={"prompt": text, "add_special_tokens": False, "return_token_strs": True},
    ).json()
    assert bare["tokens"] == llm.tokenizer.encode(text, add_special_tokens=False)
    assert "".join(bare["token_strs"]) == text
    chat = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    rendered = llm.chat_template.render(MESSAGES, add_generation_prompt=True)
    assert chat["tokens"] == llm.tokenizer.encode(rendered, add_special_tokens=False)
    closed = httpx.post(
        f"{base}/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}
    ).json()
    assert closed["count"] < chat["count"]
    back = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": bare["tokens"]})
    assert back.json() == {"prompt": text}
    for path, body, param in [
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "nope"}, "model"),
    ]:
        response = httpx.post(f"{base}{path}", json=body)
        assert response.status_code in (400, 404), response.text
        assert response.json()["error"]["param"] == param
