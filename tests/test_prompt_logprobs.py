"""Prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's; what OpenAI's ``echo`` with
``logprobs`` reports), end to end through ``resin.LLM``: every prompt token after the first gets
its logprob given the tokens before it, equal to transformers' log-softmax of its logits, with
the top k — on the torch runners (a built-in family and a model directory), the MLX runner, in
chunked prefill, next to a request that does not ask, and ahead of a prefix cache that would
otherwise skip the prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import resin
from resin.llm import LLM

REPO = Path(__file__).resolve().parents[1]
LLAMA = REPO / "tests" / "fixtures" / "llama"
PROMPT = [5, 17, 9, 33, 2, 48, 11, 60, 7, 21, 3, 90, 14, 8, 71, 19, 26]


def hf_prompt_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the log-softmax predicting prompt token i + 1."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check_against_hf(entries: list[dict[int, float] | None], want: torch.Tensor, k: int) -> None:
    prompt_len = want.shape[0] + 1
    assert len(entries) == prompt_len and entries[0] is None
    for i in range(1, prompt_len):
        entry = entries[i]
        assert entry is not None
        target = PROMPT[i] if prompt_len == len(PROMPT) else None
        if target is not None:
            assert entry[target] == pytest.approx(want[i - 1, target].item(), abs=2e-4)
        top = torch.topk(want[i - 1], k)
        for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[token_id] == pytest.approx(value, abs=2e-4)
        assert len(entry) in (k, k + 1)  # the prompt token, unless it is among the top k


@pytest.mark.parametrize("budget", [2048, 4])
def test_torch_runner_matches_transformers(budget: int) -> None:
    llm = LLM(LLAMA, max_num_batched_tokens=budget, page_size=4)
    params = resin.SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    plain = resin.SamplingParams(max_tokens=2, temperature=0.0)
    asked, other = llm.generate([PROMPT, PROMPT[:9]], [params, plain])
    check_against_hf(asked.prompt_logprobs, hf_prompt_logprobs(LLAMA, PROMPT), 3)
    assert other.prompt_logprobs is None
    # Asking changes nothing else: the same tokens as without.
    assert asked.token_ids == llm.generate([PROMPT], plain)[0].token_ids


def test_a_cached_prompt_is_computed_again_for_its_logprobs() -> None:
    llm = LLM(LLAMA, page_size=4)
    plain = resin.SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([PROMPT], plain)
    again = llm.generate([PROMPT], plain)[0]
    assert again.num_cached_tokens == 16  # the prefix cache serves the prompt's full pages...
    scored = llm.generate([PROMPT], resin.SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert scored.num_cached_tokens == 0  # ...but not to a request that needs their logits
    want = hf_prompt_logprobs(LLAMA, PROMPT)
    for i in range(1, len(PROMPT)):
        assert scored.prompt_logprobs[i] == {
            PROMPT[i]: pytest.approx(want[i - 1, PROMPT[i]].item(), abs=2e-4)
        }


def test_a_model_directory_runner_matches_transformers() -> None:
    tiny = REPO / "resin" / "models" / "gemma3" / "tiny"
    llm = LLM(tiny)
    prompt = PROMPT[:12]
    out = llm.generate([prompt], resin.SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    want = hf_prompt_logprobs(tiny, prompt)
    for i in range(1, len(prompt)):
        assert out.prompt_logprobs[i][prompt[i]] == pytest.approx(
            want[i - 1, prompt[i]].item(), abs=2e-4
        )


def test_the_mlx_runner_matches_transformers() -> None:
    pytest.importorskip("mlx.core")
    llm = LLM(LLAMA, runner="mlx", max_num_batched_tokens=8)
    out = llm.generate([PROMPT], resin.SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    check_against_hf(out.prompt_logprobs, hf_prompt_logprobs(LLAMA, PROMPT), 2)
