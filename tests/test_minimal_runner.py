"""The README's minimal runner (``examples/minimal_runner.py``) works unchanged.

Its ``Runner`` is imported from the example file as is and drives real engines: plain
decoding, chunked prefill (it returns a token for mid-prefill rows, which the engine must
ignore), more requests than ``max_num_seqs``, a small pool, and EOS = 0 (stop at once,
or after ``min_tokens``, or never with ``ignore_eos``). The script's ``main()`` runs too.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import resin

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "minimal_runner.py"
README_FORWARD = """\
    def forward(self, plan: BatchPlan) -> ForwardOutput:
        return ForwardOutput(token_ids=np.zeros(plan.num_sequences, dtype=np.uint32),
                             token_indptr=np.arange(plan.num_sequences + 1, dtype=np.uint32))
"""


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("minimal_runner", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve(config: resin.EngineConfig, requests: dict[str, tuple[list[int], resin.SamplingParams]]):
    engine = resin.Engine(config, load_example().Runner())
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.request_id not in final
            if out.finished:
                final[out.request_id] = out
    engine.check_integrity()
    assert engine.num_free_pages == config.num_pages - 1
    return final


def test_example_runner_is_the_readme_runner() -> None:
    assert README_FORWARD in EXAMPLE.read_text()
    assert README_FORWARD in (EXAMPLE.parents[1] / "README.md").read_text()


@pytest.mark.parametrize("budget", [2048, 8])
def test_minimal_runner_outputs(budget: int) -> None:
    config = resin.EngineConfig(
        page_size=4, num_pages=256, max_num_seqs=3, max_num_batched_tokens=budget, max_model_len=512
    )
    lengths = {"a": (5, 4), "b": (1, 1), "c": (30, 7), "d": (9, 16), "e": (17, 2)}
    requests = {
        r: (list(range(1, n + 1)), resin.SamplingParams(max_tokens=m))
        for r, (n, m) in lengths.items()
    }
    final = serve(config, requests)
    assert sorted(final) == sorted(lengths)
    for rid, (n, m) in lengths.items():
        out = final[rid]
        assert (out.finish_reason, out.token_ids, out.prompt_token_ids) == (
            "length",
            [0] * m,
            list(range(1, n + 1)),
        ), rid


def test_minimal_runner_with_a_small_pool() -> None:
    config = resin.EngineConfig(
        page_size=4, num_pages=10, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32
    )
    requests = {f"r{i}": ([i + 1] * 6, resin.SamplingParams(max_tokens=12)) for i in range(4)}
    final = serve(config, requests)
    assert {r: (o.finish_reason, o.token_ids) for r, o in final.items()} == {
        r: ("length", [0] * 12) for r in requests
    }


def test_minimal_runner_with_eos_zero() -> None:
    config = resin.EngineConfig(page_size=4, num_pages=64, eos_token_ids=[0], max_model_len=128)
    requests = {
        "eos": ([1, 2, 3], resin.SamplingParams(max_tokens=8)),
        "min": ([1, 2, 4], resin.SamplingParams(max_tokens=8, min_tokens=3)),
        "ignore": ([1, 2, 5], resin.SamplingParams(max_tokens=5, ignore_eos=True)),
    }
    final = serve(config, requests)
    got = {r: (o.finish_reason, o.token_ids) for r, o in final.items()}
    # This runner ignores banned_token_ids, so EOS arrives inside the min_tokens window.
    # Whether an EOS sampled as token number min_tokens stops (vLLM) or must come after
    # min_tokens tokens is not fixed by the contract: accept 3 or 4 tokens.
    assert got.pop("min") in (("stop", [0, 0, 0]), ("stop", [0, 0, 0, 0]))
    assert got == {"eos": ("stop", [0]), "ignore": ("length", [0] * 5)}


def test_example_script_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        "r1 [0, 0, 0, 0, 0, 0, 0, 0] length",
        "r2 [0, 0, 0] length",
        "r3 [0, 0, 0, 0, 0, 0] length",
    ]
