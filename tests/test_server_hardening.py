"""``resin serve`` under hostile or careless input (project issue 17, findings 1-7).

1. one huge prompt must not freeze other clients: body size limit (413), prompts that cannot fit
   refused before tokenizing, rendering and tokenizing off the event loop; /health stays fast and
   resident memory flat while a 10 MB prompt is handled;
2. malformed input (lone surrogates, NaN / Infinity, deep nesting, over-long integers) is a 400
   in the API's own format on all five POST endpoints, before any generation runs;
3. a small request cannot ask for a huge response (n × max_tokens × (1 + top_logprobs) bounded);
   large bodies are written incrementally;
4. connection limits: request-head size and time, body read timeout, idle keep-alive, max
   connections; a client cut off mid-upload costs one log line, not a traceback;
5. auth: constant-time key check, ``WWW-Authenticate`` on 401, docs pages off with a key,
   ``HEAD /health``;
6. fields that used to be ignored silently: Responses ``background`` / ``prompt``, Anthropic
   ``output_config.format`` (400) and ``thinking.display: "omitted"`` (implemented);
7. vLLM's ``return_token_ids`` on /v1/completions and /v1/chat/completions, streamed too.

The servers run in this process (``tests/server_harness.LiveServer``), so the memory figures are
this process's ``VmRSS``.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from resin.runners.scripted import ScriptedRunner
from resin.server import app as app_module
from resin.server.context import ServerOptions
from resin.server.generation import _finite
from resin.server.http_protocol import uvicorn_options
from resin.server.prompt_limits import PromptBound
from resin.server.serve import build_context
from resin.server.sse import dumps, json_pieces
from resin.tokenizer import Tokenizer
from tests.server_harness import LiveServer

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE = FIXTURES / "qwen3"
QWEN3_TEMPLATE = FIXTURES / "chat_templates" / "qwen3.jinja"
MODEL = "qwen3-tiny"
MAX_MODEL_LEN = 128
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MESSAGES_PATH, COUNT = "/v1/messages", "/v1/messages/count_tokens"
TEN_MB = 10_000_000


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def context(max_model_len: int = MAX_MODEL_LEN, runner: Any = "null", **options: Any):
    return build_context(
        FIXTURE,
        runner=runner,
        max_num_seqs=8,
        max_model_len=max_model_len,
        options=ServerOptions(served_model_names=[MODEL], **options),
    )


def serve(ctx: Any) -> LiveServer:
    return LiveServer(ctx, **uvicorn_options(ctx.options, ctx.max_num_seqs))


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with serve(context(max_request_body_bytes=64 << 20)) as live:
        yield live


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def anthropic_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert body["type"] == "error" and body["request_id"].startswith("req_")
    return body["error"]


def minimal_body(path: str, **extra: Any) -> dict[str, Any]:
    if path == CHAT:
        body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    elif path == COMPLETIONS:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    elif path == RESPONSES:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    elif path == MESSAGES_PATH:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    else:
        body = {"model": MODEL, "messages": MESSAGES}
    return {**body, **extra}


class HealthProbe:
    """Polls /health from a second thread while a request runs. ``worst`` is the longest time
    between two answers, less the pause between polls: the server runs in this process, so a
    step that holds the GIL freezes the prober too, and only the gap shows it."""

    PAUSE_S = 0.02

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60) as client:
            assert client.get("/health").status_code == 200
            last = time.perf_counter()
            while not self._stop.is_set():
                time.sleep(self.PAUSE_S)
                assert client.get("/health").status_code == 200
                now = time.perf_counter()
                self.worst = max(self.worst, now - last - self.PAUSE_S)
                last = now

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.1)
        self._stop.set()
        self._thread.join(timeout=60)


# -- 1. one large prompt -----------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, MESSAGES_PATH])
def test_10mb_prompt_keeps_health_fast_and_memory_flat(server, path):
    text = "word " * (TEN_MB // 5)
    raw = json.dumps(minimal_body(path, messages=[{"role": "user", "content": text}])).encode()
    del text
    httpx.get(f"{server.base_url}/health")
    before = rss_mb()
    with HealthProbe(server.base_url) as probe:
        response = httpx.post(
            f"{server.base_url}{path}",
            content=raw,
            timeout=120,
            headers={"content-type": "application/json"},
        )
    del raw
    if path == CHAT:
        error = openai_error(response, 400)
        assert error["code"] == "context_length_exceeded"
        assert "maximum context length" in error["message"]
    else:
        error = anthropic_error(response, 400)
        assert error["message"].startswith("prompt is too long")
    assert probe.worst < 1.0, f"/health took {probe.worst:.2f} s during a 10 MB prompt"
    time.sleep(0.2)
    assert rss_mb() - before < 100, f"RSS grew from {before:.0f} to {rss_mb():.0f} MB"


def test_large_prompt_is_tokenized_off_the_event_loop(server):
    """count_tokens must tokenize the whole prompt (no context check): 3 MB of text, 1.8M
    tokens, seconds of tokenizer time — in a worker thread, /health answering meanwhile."""
    text = "word " * 600_000
    with HealthProbe(server.base_url) as probe:
        response = httpx.post(
            f"{server.base_url}{COUNT}",
            timeout=120,
            json=minimal_body(COUNT, messages=[{"role": "user", "content": text}]),
        )
    assert response.status_code == 200
    tokenizer = server.ctx.tokenizer
    assert response.json()["input_tokens"] > len(tokenizer.encode(text[:5000])) * 100
    assert probe.worst < 1.0, f"/health took {probe.worst:.2f} s while tokenizing"


def test_body_over_the_limit_is_413_in_each_api_format():
    ctx = context()
    assert ctx.max_request_body_bytes == 4 << 20  # max(4 MiB, 128 B x 128 tokens)
    assert context(max_model_len=64 << 10).max_request_body_bytes == 8 << 20
    big = "x" * (5 << 20)
    with serve(ctx) as live:
        error = openai_error(
            httpx.post(
                f"{live.base_url}{CHAT}",
                timeout=60,
                json=minimal_body(CHAT, messages=[{"role": "user", "content": big}]),
            ),
            413,
        )
        assert error["code"] == "request_too_large" and str(4 << 20) in error["message"]
        error = anthropic_error(
            httpx.post(
                f"{live.base_url}{MESSAGES_PATH}",
                timeout=60,
                json=minimal_body(MESSAGES_PATH, x=big),
            ),
            413,
        )
        assert error["type"] == "request_too_large"

        def chunks() -> Iterator[bytes]:  # no content-length: counted as it arrives
            yield b'{"model": "qwen3-tiny", "prompt": "'
            for _ in range(5):
                yield b"x" * (1 << 20)
            yield b'"}'

        openai_error(httpx.post(f"{live.base_url}{COMPLETIONS}", content=chunks(), timeout=60), 413)
        ok = httpx.post(f"{live.base_url}{CHAT}", json=minimal_body(CHAT))
        assert ok.status_code == 200


@pytest.mark.parametrize("fixture", ["qwen3", "llama", "mistral"])
def test_prompt_bound_never_exceeds_the_token_count(fixture):
    tokenizer = Tokenizer.from_pretrained(FIXTURES / fixture)
    bound = PromptBound.for_tokenizer(tokenizer)
    assert bound is not None
    texts = [
        "",
        "a",
        "word " * 300,
        " " * 5000,
        "\n\n\t" * 100,
        "<|im_start|>" * 50,
        "ééé e\u0301 한국어 \U0001f600" * 40,
        "".join(chr(c) for c in range(32, 3000)),
        "0123456789" * 200,
        "\x00\x01\x7f" * 100,
    ]
    for text in texts:
        assert bound.min_tokens(text) <= len(tokenizer.encode(text, add_special_tokens=False))
        assert len(text) <= bound.max_chars(len(tokenizer.encode(text)) + 1)


def _backend_tokenizer(model: Any, normalizer: Any = None, pre: Any = None) -> Tokenizer:
    backend = BackendTokenizer(model)
    if normalizer is not None:
        backend.normalizer = normalizer
    if pre is not None:
        backend.pre_tokenizer = pre
    return Tokenizer(backend, {})


def test_prompt_bound_only_where_it_is_sound():
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"ĠĠĠĠ": 256}
    bpe = _backend_tokenizer(models.BPE(vocab, []), pre=byte_level)
    assert PromptBound.for_tokenizer(bpe) == PromptBound(4, 1.0)
    nfc = _backend_tokenizer(models.BPE(vocab, []), normalizers.NFC(), byte_level)
    assert PromptBound.for_tokenizer(nfc) == PromptBound(4, 4.0)
    # text can vanish: whitespace splitting, stripping, a missing byte, WordPiece's [UNK]
    for tokenizer in (
        _backend_tokenizer(models.BPE(vocab, []), pre=pre_tokenizers.WhitespaceSplit()),
        _backend_tokenizer(models.BPE(vocab, []), normalizers.Strip(), byte_level),
        _backend_tokenizer(models.BPE({"a": 0}, []), pre=byte_level),
        _backend_tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
    ):
        assert PromptBound.for_tokenizer(tokenizer) is None


# -- 2. malformed input ------------------------------------------------------------------------

POSTS = [CHAT, COMPLETIONS, RESPONSES, MESSAGES_PATH, COUNT]
TEXT_FIELD = {
    CHAT: "messages",
    COMPLETIONS: "prompt",
    RESPONSES: "input",
    MESSAGES_PATH: "messages",
    COUNT: "messages",
}


def _with_text(path: str, text_json: str) -> str:
    """The endpoint's minimal body as JSON text, its prompt text replaced by ``text_json``."""
    body = json.dumps(minimal_body(path))
    return body.replace('"hi"', text_json, 1)


MALFORMED = {
    "surrogate-in-text": lambda path: _with_text(path, '"a \\ud800 b"'),
    "surrogate-in-model": lambda path: json.dumps(minimal_body(path)).replace(
        '"qwen3-tiny"', '"claude-\\udc00"' if path.startswith("/v1/messages") else '"\\ud83d"'
    ),
    "surrogate-in-key": lambda path: json.dumps(minimal_body(path))[:-1] + ', "\\ud800": 1}',
    "nan": lambda path: json.dumps(minimal_body(path))[:-1] + ', "metadata": {"x": NaN}}',
    "infinity": lambda path: json.dumps(minimal_body(path))[:-1] + ', "temperature": -Infinity}',
    "overflowing-float": lambda path: json.dumps(minimal_body(path))[:-1] + ', "top_p": 1e999}',
    "deep-nesting": lambda path: (
        json.dumps(minimal_body(path))[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    ),
    "moderately-deep": lambda path: (
        json.dumps(minimal_body(path))[:-1] + ', "tools": ' + "[" * 500 + "]" * 500 + "}"
    ),
    "5000-digit-integer": lambda path: (
        json.dumps(minimal_body(path))[:-1] + ', "max_tokens": ' + "9" * 5000 + "}"
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
@pytest.mark.parametrize("path", POSTS)
def test_malformed_json_is_400_before_generation(server, path, case):
    raw = MALFORMED[case](path)
    generated = server.metric("resin:prompt_tokens_total")
    for stream in (False, True):
        text = raw if path == COUNT else raw[:-1] + f', "stream": {json.dumps(stream)}}}'
        response = httpx.post(
            f"{server.base_url}{path}",
            content=text.encode(),
            timeout=60,
            headers={"content-type": "application/json"},
        )
        if path.startswith("/v1/messages"):
            assert anthropic_error(response, 400)["type"] == "invalid_request_error"
        else:
            assert openai_error(response, 400)["type"] == "invalid_request_error"
    assert server.metric("resin:prompt_tokens_total") == generated
    ok = httpx.post(f"{server.base_url}{path}", json=minimal_body(path))
    assert ok.status_code == 200, ok.text


def test_every_response_is_strict_json():
    assert _finite(float("-inf")) == -9999.0 and _finite(float("nan")) == -9999.0
    assert _finite(-1.5) == -1.5
    with pytest.raises(ValueError):
        dumps({"logprob": float("nan")})


# -- 3. amplification --------------------------------------------------------------------------


def test_logprob_amplification_is_bounded():
    with serve(context(max_model_len=1024)) as live:
        error = openai_error(
            httpx.post(
                f"{live.base_url}{CHAT}",
                json={
                    "model": MODEL,
                    "messages": MESSAGES,
                    "n": 128,
                    "logprobs": True,
                    "top_logprobs": 20,
                    "max_tokens": 490,
                },
            ),
            400,
        )
        assert error["param"] == "top_logprobs"
        assert "128 x 490 x 21 = 1317120" in error["message"]
        assert "1048576" in error["message"] and "--max-logprob-entries" in error["message"]
        error = openai_error(
            httpx.post(
                f"{live.base_url}{COMPLETIONS}",
                json={
                    "model": MODEL,
                    "prompt": ["a", "b"],
                    "n": 128,
                    "logprobs": 5,
                    "max_tokens": 700,
                },
            ),
            400,
        )
        assert error["param"] == "logprobs" and "2 prompts x" in error["message"]
    # the null runner computes no logprobs: the tiny model on the torch runner does
    with serve(context(max_model_len=1024, runner="torch", max_logprob_entries=10_000)) as live:
        error = openai_error(
            httpx.post(
                f"{live.base_url}{RESPONSES}",
                json={"model": MODEL, "input": "hi", "top_logprobs": 20, "max_output_tokens": 500},
            ),
            400,
        )
        assert "500 x 21 = 10500" in error["message"]
        fits = httpx.post(
            f"{live.base_url}{CHAT}",
            json={
                "model": MODEL,
                "messages": MESSAGES,
                "n": 4,
                "logprobs": True,
                "top_logprobs": 20,
                "max_tokens": 100,
                "ignore_eos": True,
            },
        )
        assert fits.status_code == 200
        assert "content-length" not in fits.headers  # written incrementally
        choices = fits.json()["choices"]
        assert [len(c["logprobs"]["content"]) for c in choices] == [100] * 4
        assert all(len(e["top_logprobs"]) == 20 for c in choices for e in c["logprobs"]["content"])


def test_incremental_json_is_the_same_json():
    value = {
        "choices": [
            {
                "index": i,
                "logprobs": {
                    "content": [
                        {
                            "token": 'é\n"',
                            "logprob": -1.5,
                            "top_logprobs": [{"t": j} for j in range(3)],
                        }
                        for _ in range(100)
                    ]
                },
                "text": "x" * 10,
            }
            for i in range(3)
        ],
        "usage": {"a": 1},
        "empty": [],
        "none": None,
        "flat": list(range(1000)),
    }
    pieces = list(json_pieces(value))
    assert "".join(pieces) == dumps(value)
    assert max(len(p) for p in pieces) < len(dumps(value)) / 10


def test_a_large_answers_logprobs_are_built_as_the_very_json_of_their_dicts() -> None:
    """A non-streamed chat answer's logprobs are built as JSON text (a million small dicts
    stalled every client: their build, and the cyclic GC's passes over them), which
    ``json_pieces`` writes as is; the bytes are those of the dicts a stream chunk carries."""
    from resin.server.generation import TokenLogprob
    from resin.server.openai.chat import LogprobFragments, logprobs_content
    from resin.server.sse import RawJSON

    entries = [
        TokenLogprob(5, 'q"uo\\te\n', -1.5, [(1, "é", -0.0), (2, "\u2028", -1e-07)]),
        TokenLogprob(6, "", -9999.0, []),
        TokenLogprob(7, "\U0001f600", -3.0, [(3, " x", -12.375)] * 3),
    ]
    fragments = LogprobFragments()
    text = "[" + fragments.content(entries[:2]) + "," + fragments.content(entries[2:]) + "]"
    assert text == dumps(logprobs_content(entries))
    body = {"choices": [{"logprobs": {"content": RawJSON(text)}}]}
    assert json.loads("".join(json_pieces(body))) == {
        "choices": [{"logprobs": {"content": logprobs_content(entries)}}]
    }
    with pytest.raises(TypeError):
        dumps(body)  # only the incremental writer knows it


# -- 4. connection limits ----------------------------------------------------------------------


def _connect(live: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    return sock


def _read_all(sock: socket.socket, timeout: float = 10) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


@pytest.fixture(scope="module")
def strict() -> Iterator[LiveServer]:
    ctx = context(
        timeout_header=1.0, timeout_body=1.0, timeout_keep_alive=1.0, max_header_bytes=8192
    )
    with serve(ctx) as live:
        yield live


def test_oversized_request_head_is_431(strict):
    """A whole head over the limit, a long URL, many headers, and a header line that never
    ends (cut off once the bytes received exceed the limit, before the line is complete)."""
    endless = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 16384
    for head in (
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
        b"GET /health?" + b"q" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 2000 + b"\r\n",
        endless,
    ):
        sock = _connect(strict)
        sock.sendall(head)
        reply = _read_all(sock)
        sock.close()
        assert reply.startswith(b"HTTP/1.1 431 "), reply[:100]
        assert b"--max-header-bytes" in reply
    assert httpx.get(f"{strict.base_url}/health", headers={"x-ok": "y" * 4000}).status_code == 200


def test_slow_request_head_and_idle_connections_are_closed(strict):
    sock = _connect(strict)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
    started = time.monotonic()
    reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started < 5
    sock.close()
    silent = _connect(strict)  # sends nothing at all: closed, no response
    started = time.monotonic()
    assert _read_all(silent) == b"" and time.monotonic() - started < 5
    silent.close()
    kept = _connect(strict)  # one request, then idle past --timeout-keep-alive
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    started = time.monotonic()
    reply = _read_all(kept)
    assert reply.startswith(b"HTTP/1.1 200 ") and time.monotonic() - started < 5
    kept.close()


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def server_logs() -> Iterator[Records]:
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("resin.server", "uvicorn.error")]
    for log in loggers:
        log.addHandler(handler)
    yield handler
    for log in loggers:
        log.removeHandler(handler)


def test_slow_body_is_408_and_cut_upload_is_one_log_line(strict, server_logs):
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
        b"\r\ncontent-length: 1000\r\n\r\n"
    )
    slow = _connect(strict)
    slow.sendall(head + b'{"model": ')
    started = time.monotonic()
    reply = _read_all(slow)
    slow.close()
    assert reply.startswith(b"HTTP/1.1 408 ") and time.monotonic() - started < 5
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    server_logs.records.clear()
    cut = _connect(strict)
    cut.sendall(head + b'{"model": "qwen3-tiny", ')
    time.sleep(0.3)
    cut.close()
    time.sleep(0.5)
    assert httpx.get(f"{strict.base_url}/health").status_code == 200
    assert not [r for r in server_logs.records if r.exc_info or r.levelno >= logging.ERROR]
    lines = [r.getMessage() for r in server_logs.records if r.name == "resin.server"]
    assert len(lines) == 1 and "disconnected" in lines[0], lines


def test_max_connections():
    with serve(context(max_connections=3)) as live:
        assert uvicorn_options(live.ctx.options, 8)["limit_concurrency"] == 3
        idle = [_connect(live) for _ in range(2)]
        time.sleep(0.2)
        assert httpx.get(f"{live.base_url}/health").status_code == 503
        for sock in idle:
            sock.close()
        time.sleep(0.2)
        assert httpx.get(f"{live.base_url}/health").status_code == 200
    assert (
        uvicorn_options(ServerOptions(served_model_names=["m"]), 256)["limit_concurrency"]
        == 256 + 4096 + 128
    )


# -- 5. auth hardening -------------------------------------------------------------------------


def test_auth_docs_and_head_health():
    with serve(context(api_key="sekrit")) as live:
        denied = httpx.get(f"{live.base_url}/v1/models")
        assert denied.status_code == 401
        assert denied.headers["www-authenticate"].startswith("Bearer")
        with mock.patch.object(
            app_module.secrets, "compare_digest", wraps=app_module.secrets.compare_digest
        ) as compare:
            ok = httpx.get(f"{live.base_url}/v1/models", headers={"x-api-key": "sekrit"})
            assert ok.status_code == 200 and compare.called
        assert (
            httpx.get(
                f"{live.base_url}/v1/models", headers={"authorization": "bearer sekrit"}
            ).status_code
            == 200
        )
        assert (
            httpx.get(
                f"{live.base_url}/v1/models", headers={"authorization": "Bearer sekri"}
            ).status_code
            == 401
        )
        for page in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(f"{live.base_url}{page}").status_code == 404
        head = httpx.head(f"{live.base_url}/health")
        assert head.status_code == 200 and head.content == b""
    with serve(context(api_key="sekrit", enable_docs=True)) as live:
        assert httpx.get(f"{live.base_url}/docs").status_code == 200
    with serve(context()) as live:
        assert httpx.get(f"{live.base_url}/openapi.json").status_code == 200
    with serve(context(enable_docs=False)) as live:
        assert httpx.get(f"{live.base_url}/docs").status_code == 404


# -- 6. silently ignored fields ----------------------------------------------------------------

SCRIPT = "<think>\nplan\n</think>\n\nSure."


@pytest.fixture(scope="module")
def scripted() -> Iterator[LiveServer]:
    tokenizer = Tokenizer.from_pretrained(FIXTURE)
    runner = ScriptedRunner(
        tokenizer.encode(SCRIPT, add_special_tokens=False), tokenizer.eos_token_ids[0]
    )
    ctx = build_context(
        FIXTURE,
        runner=runner,
        max_num_seqs=8,
        max_model_len=2048,
        options=ServerOptions(served_model_names=[MODEL], chat_template=QWEN3_TEMPLATE.read_text()),
    )
    with serve(ctx) as live:
        yield live


@pytest.mark.parametrize("field,value", [("background", True), ("prompt", {"id": "pmpt_1"})])
def test_responses_background_and_stored_prompts_are_400(server, field, value):
    for stream in (False, True):
        error = openai_error(
            httpx.post(
                f"{server.base_url}{RESPONSES}",
                json=minimal_body(RESPONSES, stream=stream, **{field: value}),
            ),
            400,
        )
        assert error["param"] == field
    ok = httpx.post(f"{server.base_url}{RESPONSES}", json=minimal_body(RESPONSES, background=False))
    assert ok.status_code == 200


def test_anthropic_output_config_format_is_400(server):
    schema = {"type": "json_schema", "schema": {"type": "object"}}
    error = anthropic_error(
        httpx.post(
            f"{server.base_url}{MESSAGES_PATH}",
            json=minimal_body(MESSAGES_PATH, output_config={"format": schema}),
        ),
        400,
    )
    assert "output_config.format" in error["message"] and "not supported" in error["message"]
    ok = httpx.post(
        f"{server.base_url}{MESSAGES_PATH}",
        json=minimal_body(MESSAGES_PATH, output_config={"effort": "high"}),
    )
    assert ok.status_code == 200


def test_thinking_display_omitted(scripted):
    body = {
        "model": MODEL,
        "max_tokens": 100,
        "messages": MESSAGES,
        "thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
    }
    shown = httpx.post(
        f"{scripted.base_url}{MESSAGES_PATH}",
        json={**body, "thinking": {"type": "enabled", "budget_tokens": 1024}},
    ).json()
    assert shown["content"][0]["thinking"] == "plan"
    message = httpx.post(f"{scripted.base_url}{MESSAGES_PATH}", json=body).json()
    assert [b["type"] for b in message["content"]] == ["thinking", "text"]
    thinking, text = message["content"]
    assert thinking["thinking"] == "" and thinking["signature"]
    assert text["text"] == "Sure."
    events = []
    with httpx.stream(
        "POST", f"{scripted.base_url}{MESSAGES_PATH}", json={**body, "stream": True}
    ) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert "thinking_delta" not in deltas and "signature_delta" in deltas
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert starts[0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert (
        "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        == "Sure."
    )


# -- 7. return_token_ids -----------------------------------------------------------------------


def _stream_chunks(live: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", f"{live.base_url}{path}", json={**body, "stream": True}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_return_token_ids_chat(server):
    ctx = server.ctx
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 6,
        "ignore_eos": True,
        "n": 2,
        "return_token_ids": True,
    }
    result = httpx.post(f"{server.base_url}{CHAT}", json=body).json()
    rendered = ctx.chat_template.render(MESSAGES, add_generation_prompt=True)
    assert result["prompt_token_ids"] == ctx.tokenizer.encode(rendered, add_special_tokens=False)
    assert len(result["prompt_token_ids"]) == result["usage"]["prompt_tokens"]
    for choice in result["choices"]:
        assert len(choice["token_ids"]) == 6
        assert ctx.tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]
    chunks = _stream_chunks(server, CHAT, body)
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]].extend(choice["token_ids"])
            if "role" in choice["delta"]:
                assert chunk["prompt_token_ids"] == result["prompt_token_ids"]
            else:
                assert "prompt_token_ids" not in chunk
    assert [streamed[0], streamed[1]] == [c["token_ids"] for c in result["choices"]]
    plain = httpx.post(f"{server.base_url}{CHAT}", json={**body, "return_token_ids": False}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    openai_error(
        httpx.post(f"{server.base_url}{CHAT}", json={**body, "return_token_ids": "yes"}), 400
    )


def test_return_token_ids_completions(server):
    tokenizer = server.ctx.tokenizer
    body = {
        "model": MODEL,
        "prompt": ["hello there", [5, 6, 7]],
        "max_tokens": 5,
        "n": 2,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    result = httpx.post(f"{server.base_url}{COMPLETIONS}", json=body).json()
    prompts = [tokenizer.encode("hello there"), [5, 6, 7]]
    for choice in result["choices"]:
        assert choice["prompt_token_ids"] == prompts[choice["index"] // 2]
        assert len(choice["token_ids"]) == 5
        assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    streamed: dict[int, list[int]] = {i: [] for i in range(4)}
    for chunk in _stream_chunks(server, COMPLETIONS, body):
        for choice in chunk["choices"]:
            if not streamed[choice["index"]]:
                assert choice["prompt_token_ids"] == prompts[choice["index"] // 2]
            else:
                assert "prompt_token_ids" not in choice
            streamed[choice["index"]].extend(choice["token_ids"])
    assert [streamed[i] for i in range(4)] == [c["token_ids"] for c in result["choices"]]
