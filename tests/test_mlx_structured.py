"""Structured outputs enforced on the MLX runner, as on torch (tests/test_structured_output.py).

- ``resin serve``'s context on ``runner="mlx"`` takes grammars (``ctx.structured`` is set); on
  the random-weight Qwen3 fixture a Chat ``json_schema`` answer (greedy and sampled) parses and
  matches the schema, and ``tool_choice: "required"`` gives one well-formed call whose
  arguments match its tool's schema — neither of which the fixture writes unconstrained
  (the control below).
- The MLX sampler on a fixed random logit table, for both grammar engines: every request ends
  in schema-valid JSON; discarded plans and preemption (chunked prefill, one-token pages) give
  the same tokens as a plain run; ``min_tokens`` banning the stop token where the grammar
  allows nothing else samples under the grammar alone; a constrained verify row raises.
- With llguidance (the default engine) the masks are filled with its numpy fill: a JSON answer
  generated through ``resin.LLM(runner="mlx")`` with a registered grammar loads no torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("llguidance")
xgr = pytest.importorskip("xgrammar")

import resin  # noqa: E402
from resin.runners.mlx.sampler import MlxSampler  # noqa: E402
from resin.sampling_state import sampling_rows  # noqa: E402
from resin.server.context import ServerOptions  # noqa: E402
from resin.server.serve import build_context  # noqa: E402
from resin.structured_output import GrammarCompiler  # noqa: E402
from tests.server_harness import LiveServer  # noqa: E402
from tests.test_structured_output import (  # noqa: E402
    CHAT_TOOLS,
    MESSAGES,
    RESPONSE_FORMAT,
    SCHEMA,
    SCHEMAS,
    TINY_SCHEMA,
    VOCAB,
    check,
)

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "qwen3"
MODEL = "qwen3-tiny-mlx"
ENGINES = ("llguidance", "xgrammar")


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    ctx = build_context(
        FIXTURE,
        runner="mlx",
        options=ServerOptions(served_model_names=[MODEL]),
        max_num_seqs=4,
        max_model_len=1024,
    )
    assert type(ctx.loop.runner).__name__ == "MlxRunner"
    assert ctx.structured is not None  # grammars enforced, not "not enforced"
    with LiveServer(ctx) as live:
        yield live


def chat(server: LiveServer, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, **fields}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answer_parses_and_validates(server: LiveServer, temperature: float) -> None:
    result = chat(server, response_format=RESPONSE_FORMAT, temperature=temperature, n=2, seed=3)
    for choice in result["choices"]:
        assert choice["finish_reason"] == "stop"
        check(json.loads(choice["message"]["content"]), SCHEMA)


def test_unconstrained_output_is_not_that_json(server: LiveServer) -> None:
    content = chat(server, temperature=0)["choices"][0]["message"]["content"]
    with pytest.raises((ValueError, AssertionError, KeyError, TypeError)):
        check(json.loads(content), SCHEMA)


def test_forced_tool_call(server: LiveServer) -> None:
    result = chat(server, tools=CHAT_TOOLS, tool_choice="required", temperature=1.0, seed=1, n=2)
    for choice in result["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        name = call["function"]["name"]
        check(json.loads(call["function"]["arguments"]), SCHEMAS[name])
    assert not server.ctx.structured.registry.active  # released when the request ended


# -- the MLX sampler's grammar state on a fixed logit table ---------------------------------


def tiny_grammar(engine: str) -> Any:
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, stop_token_ids=[0])
    return GrammarCompiler.from_info(info, engine=engine).json_schema(TINY_SCHEMA, "schema")


class MlxGrammarRunner:
    """Logits = a fixed random table[last token], sampled by :class:`MlxSampler`; every
    request follows ``grammar``; fails (after begin_step) on the calls in ``fail_calls``."""

    def __init__(self, grammar: Any, fail_calls: frozenset[int] = frozenset()) -> None:
        self.sampler = MlxSampler(len(VOCAB))
        self.grammar = grammar
        table = np.random.default_rng(2).normal(0.0, 3.0, (len(VOCAB), len(VOCAB)))
        self.table = mx.array(table.astype(np.float32))
        self.fail_calls, self.calls = fail_calls, 0

    def forward(self, plan: Any) -> Any:
        self.calls += 1
        for request_id in plan.request_ids:
            self.sampler.grammars.register(request_id, self.grammar)
        self.sampler.begin_step(plan)
        if self.calls in self.fail_calls:
            raise RuntimeError("fails after begin_step")
        rows, positions = sampling_rows(plan)  # a verify row: one sample per token it checks
        last = plan.input_ids[positions].astype(np.int32)
        return self.sampler.sample(self.table[mx.array(last)], plan, rows)


def run_engine(runner: MlxGrammarRunner, **config: Any) -> dict[str, list[int]]:
    engine = resin.Engine(
        resin.EngineConfig(
            **{"page_size": 4, "num_pages": 64, "max_model_len": 64, "eos_token_ids": [0], **config}
        ),
        runner,
    )
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7, 8, 9], "b": [1, 2, 3, 4, 5, 6, 7, 8, 20, 21], "c": [3]}
    params = [
        resin.SamplingParams(max_tokens=28, temperature=0.0),
        resin.SamplingParams(max_tokens=28, temperature=1.0, seed=7),
    ]
    for copy in range(2):
        for name, prompt in prompts.items():
            engine.add_request(f"{name}{copy}", prompt, params[copy])
    finished: dict[str, list[int]] = {}
    for _ in range(800):
        if not engine.has_unfinished():
            break
        try:
            outputs = engine.step()
        except resin.StepError:
            continue
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out.token_ids
    return finished


def _text(tokens: list[int]) -> str:
    return "".join(VOCAB[t] for t in tokens)


@pytest.mark.parametrize("engine", ENGINES)
def test_sampler_grammar_survives_failed_plans_and_preemption(engine: str) -> None:
    grammar = tiny_grammar(engine)
    expected = run_engine(MlxGrammarRunner(grammar))
    assert len(expected) == 6
    for tokens in expected.values():
        assert tokens[-1] == 0, _text(tokens)
        check(json.loads(_text(tokens[:-1])), TINY_SCHEMA)
    failing = run_engine(MlxGrammarRunner(grammar, fail_calls=frozenset({2, 5, 9})))
    assert failing == expected
    squeezed = {"page_size": 1, "num_pages": 48, "max_model_len": 40, "max_num_batched_tokens": 5}
    assert run_engine(MlxGrammarRunner(grammar), **squeezed) == expected


@pytest.mark.parametrize("engine", ENGINES)
def test_sampler_grammar_wins_over_bans(engine: str) -> None:
    runner = MlxGrammarRunner(tiny_grammar(engine))
    engine_ = resin.Engine(
        resin.EngineConfig(page_size=4, num_pages=64, max_model_len=64, eos_token_ids=[0]), runner
    )
    engine_.add_request("r", [1, 2, 3], resin.SamplingParams(max_tokens=40, min_tokens=35))
    tokens: list[int] = []
    while engine_.has_unfinished():
        for out in engine_.step():
            tokens = out.token_ids
    end = tokens.index(0)
    check(json.loads(_text(tokens[:end])), TINY_SCHEMA)


def test_constrained_verify_row_raises() -> None:
    runner = MlxGrammarRunner(tiny_grammar("llguidance"))
    engine = resin.Engine(
        resin.EngineConfig(
            page_size=4,
            num_pages=64,
            max_model_len=64,
            eos_token_ids=[0],
            num_speculative_tokens=2,
        ),
        runner,
    )
    engine.add_request("r", [1, 7, 1, 7, 1, 7], resin.SamplingParams(max_tokens=20))
    with pytest.raises(Exception, match="num_speculative_tokens = 0"):
        for _ in range(40):
            engine.step()


def test_llguidance_masks_load_no_torch() -> None:
    code = f"""
import json, sys
import resin
from resin.llm import LLM
from resin.structured_output import GrammarCompiler, ENGINE
assert ENGINE == "llguidance", ENGINE
llm = LLM({str(FIXTURE)!r}, runner="mlx", max_num_seqs=2, max_model_len=256)
compiler = GrammarCompiler(llm.tokenizer, llm.model_config.vocab_size, llm.tokenizer.eos_token_ids)
schema = json.loads({json.dumps(TINY_SCHEMA)!r})
grammar = compiler.json_schema(schema, "schema")
registry = llm.runner.sampler.grammars
class Registering:  # the engine, registering the grammar for each request it is given
    def __init__(self, inner):
        self.inner = inner
    def add_request(self, request_id, *args, **kwargs):
        registry.register(request_id, grammar)
        return self.inner.add_request(request_id, *args, **kwargs)
    def __getattr__(self, name):
        return getattr(self.inner, name)
llm.engine = Registering(llm.engine)
out = llm.generate("Give me the data.", resin.SamplingParams(max_tokens=60, temperature=0))
value = json.loads(out[0].text)
assert set(value) == {{"a", "b"}} and isinstance(value["a"], bool), value
print(sorted({{m.split('.')[0] for m in sys.modules}} & {{'torch', 'transformers'}}))
"""
    env = {**os.environ, "RESIN_GRAMMAR_ENGINE": "llguidance"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
