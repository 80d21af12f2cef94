"""What hostile-client fuzzing found, through a live server (the parsers' share is in
tests/test_server_parsers.py):

- a stop string ends the choice at the token that completes it: tokens that arrived with it
  (a verify row's accepted drafts under n-gram speculative decoding) are not in the token ids,
  the logprobs or the usage either — the same response as without speculative decoding;
- a choice ended by a stop string counts as a stop in ``/metrics``, not as an abort;
- a stop string longer than ``MAX_STOP_STRING_CHARS`` is a 400 in each API's format (matching
  many-kilobyte stop strings stalled every client);
- a chat logprob's ``bytes`` are the token's own where its text is U+FFFD (part of a character);
- tool-call arguments sent back with a lone surrogate escape are a 400, not a 500;
- an Anthropic-format 4xx with no type of its own (a 405) is an ``invalid_request_error``, not
  an ``api_error`` (which clients read as the server's fault).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from resin.server.context import ServerOptions
from resin.server.request_fields import MAX_STOP_STRING_CHARS
from resin.server.serve import build_context
from tests.server_harness import LiveServer

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3"
MODEL = "tiny"


def live(**engine: Any) -> LiveServer:
    options = ServerOptions(served_model_names=[MODEL])
    return LiveServer(build_context(FIXTURE, options=options, max_num_seqs=4, **engine))


def stopped_completion(base_url: str) -> tuple[dict[str, Any], str]:
    """A greedy completion cut by a stop string, from a prompt whose continuation repeats
    (so n-gram drafts are accepted several at a time), and the stop string."""
    client = httpx.Client(base_url=base_url, timeout=60)
    first = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 40, "temperature": 0,
              "return_token_ids": True},
    ).json()["choices"][0]  # fmt: skip
    prompt = first["prompt_token_ids"] + first["token_ids"][:6]
    stop = " re"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0, "stop": stop,
            "logprobs": 0, "return_token_ids": True}  # fmt: skip
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json(), stop


def test_a_stop_string_ends_the_choice_at_its_token() -> None:
    with live() as plain:
        expected, stop = stopped_completion(plain.base_url)
    with live(speculative_method="ngram", num_speculative_tokens=4) as speculative:
        got, _ = stopped_completion(speculative.base_url)
    choice = got["choices"][0]
    assert choice["finish_reason"] == "stop"
    tokens = choice["logprobs"]["tokens"]
    # The stop string is completed by the last token, not before it.
    assert stop in "".join(tokens) and stop not in "".join(tokens[:-1])
    assert len(choice["token_ids"]) == len(tokens) == got["usage"]["completion_tokens"]
    for key in ("text", "token_ids", "finish_reason", "logprobs"):
        assert choice[key] == expected["choices"][0][key], key
    assert got["usage"] == expected["usage"]


def stop_count(base_url: str, reason: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    label = f'finished_reason="{reason}"'
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("resin:request_success_total{") and label in line
    )


def test_a_stop_string_counts_as_a_stop_in_the_metrics() -> None:
    with live() as server:
        stopped_completion(server.base_url)  # its first request ends by length
        assert stop_count(server.base_url, "stop") == 1
        assert stop_count(server.base_url, "abort") == 0


def test_an_overlong_stop_string_is_a_400() -> None:
    long_stop = "x" * (MAX_STOP_STRING_CHARS + 1)
    with live() as server:
        ok = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                  "stop": ["y" * MAX_STOP_STRING_CHARS]},
        )  # fmt: skip
        assert ok.status_code == 200, ok.text
        openai = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 2, "stop": ["a", long_stop]},
        )  # fmt: skip
        assert openai.status_code == 400
        error = openai.json()["error"]
        assert error["param"] == "stop" and str(MAX_STOP_STRING_CHARS) in error["message"]
        anthropic = httpx.post(
            f"{server.base_url}/v1/messages",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 2, "stop_sequences": [long_stop]},
        )  # fmt: skip
        assert anthropic.status_code == 400
        assert anthropic.json()["error"]["type"] == "invalid_request_error"


def test_an_anthropic_4xx_without_its_own_type_is_an_invalid_request() -> None:
    with live() as server:
        response = httpx.get(f"{server.base_url}/v1/messages")  # POST only: a 405
        assert response.status_code == 405
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_chat_logprob_bytes_are_the_tokens_own() -> None:
    """A token holding part of a character: its ``bytes`` are its own (OpenAI's field, which
    clients join to rebuild the text), not the UTF-8 of the U+FFFD its text decodes to."""
    from resin.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(FIXTURE)
    lead = tokenizer.token_to_id("Ã")  # byte 0xC3 in GPT-2's byte-level alphabet: "é"'s first
    assert lead is not None and tokenizer.decode([lead]) == "\ufffd"
    with live() as server:
        response = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 1, "logprobs": True, "top_logprobs": 3,
                  "logit_bias": {str(lead): 100}},
        )  # fmt: skip
        assert response.status_code == 200, response.text
        (entry,) = response.json()["choices"][0]["logprobs"]["content"]
        assert entry["token"] == "\ufffd" and entry["bytes"] == [0xC3]


def test_tool_call_arguments_with_a_lone_surrogate_are_a_400() -> None:
    """A "\\ud83d" escape inside the arguments string decodes to half a character, which the
    body's own check cannot see: a 400 naming it, not the tokenizer's 500."""
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "f", "arguments": '{"city": "\\ud83d"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    with live() as server:
        response = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 2},
        )
        assert response.status_code == 400, response.text
        assert "surrogate" in response.json()["error"]["message"]
