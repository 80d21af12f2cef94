"""Speculative decoding with the n-gram drafter, end to end on real models: identical tokens.

The engine proposes drafts (prompt lookup over the request's tokens), the runner samples every
position of a verify row, the engine commits the agreed prefix plus one: so greedy output with
speculation on must be token-for-token the output with it off, on every model in CI that
supports it — under chunked prefill, prefix-cache hits and preemption — and so must seeded
sampling (the j-th sample of a verify row draws from output index num_output_tokens + j's
generator). Prompts repeat a phrase, so drafts are proposed and accepted (checked on the
metrics). Unseeded sampling keeps the target distribution (a chi-square test against
speculation off, with a planted bias it catches). Qwen3-Next's recurrent states roll back: the
engine saves each state into a spare before a verify row and restores it after a rejection.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import resin  # noqa: E402
from resin.llm import LLM  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    "llama": REPO / "tests" / "fixtures" / "llama",
    "gpt_oss": REPO / "resin" / "models" / "gpt_oss" / "tiny",
    "gemma3": REPO / "resin" / "models" / "gemma3" / "tiny",
    "deepseek_v4_flash": REPO / "resin" / "models" / "deepseek_v4_flash" / "tiny",
    "qwen3_next": REPO / "resin" / "models" / "qwen3_next" / "tiny",  # recurrent: rollback
}
PHRASE = [17, 42, 99, 7, 63]
PROMPTS = [
    PHRASE * 4,
    [5, 6] + PHRASE * 3 + [11],
    [(13 * i) % 200 + 3 for i in range(23)],
    PHRASE * 2 + [8, 9, 10] * 3,
]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _metric(llm: LLM, name: str) -> float:
    match = re.search(rf"^resin:{name}(?:\{{\}})? (\S+)", llm.engine.metrics_text(), re.M)
    assert match, name
    return float(match.group(1))


def _metric_at(llm: LLM, name: str, position: int) -> float:
    match = re.search(
        rf'^resin:{name}\{{position="{position}"\}} (\S+)', llm.engine.metrics_text(), re.M
    )
    assert match, (name, position)
    return float(match.group(1))


def _generate(model: Path, k: int, params: resin.SamplingParams, **engine) -> tuple[list, LLM]:
    engine = {"max_model_len": 128, **engine}
    llm = LLM(model, max_num_seqs=4, num_speculative_tokens=k, **engine)
    return [out.token_ids for out in llm.generate(PROMPTS, params)], llm


def _small_pool(model: Path) -> int:
    """A pool of 4-token pages barely above one 64-token request: the four ~45-token requests
    must take turns (preemption)."""
    llm = LLM(model, max_num_seqs=4, max_model_len=64, page_size=4, max_num_batched_tokens=16)
    layout = resin.CacheLayout.from_specs(llm.runner.cache_spec(), 4)
    per_request = layout.pages_per_request(64, 16, True, 2)  # spare states, if recurrent
    return 1 + per_request + per_request // 5


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_is_identical_with_speculation(name: str) -> None:
    params = resin.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    off, _ = _generate(MODELS[name], 0, params)
    accepted = 0.0
    for k, engine in [
        (1, {}),
        (4, {}),
        (3, {"max_num_batched_tokens": 7}),  # chunked prefill; verify rows cut to the budget
        (
            2,
            {
                "page_size": 4,
                "max_model_len": 64,
                "max_num_batched_tokens": 16,
                "num_pages": _small_pool(MODELS[name]),
            },
        ),  # a small pool: preemption
    ]:
        on, llm = _generate(MODELS[name], k, params, **engine)
        assert on == off, (name, k, engine)
        if "num_pages" in engine:
            assert _metric(llm, "num_preemptions_total") > 0
        assert _metric(llm, "spec_decode_num_drafts_total") > 0
        accepted += _metric(llm, "spec_decode_num_accepted_tokens_total")
    if name != "qwen3_next":  # its random tiny weights never repeat: the oracle test covers it
        assert accepted > 0, "some drafts must be accepted"
    # Prefix hits: the same prompts again on one engine.
    llm = LLM(MODELS[name], max_num_seqs=4, max_model_len=128, num_speculative_tokens=3)
    first = [o.token_ids for o in llm.generate(PROMPTS, params)]
    again = llm.generate(PROMPTS, params)
    assert first == off and [o.token_ids for o in again] == off
    assert sum(o.num_cached_tokens for o in again) > 0


def test_seeded_sampling_is_identical_with_speculation() -> None:
    params = resin.SamplingParams(
        max_tokens=24, temperature=0.7, top_p=0.95, seed=3, ignore_eos=True
    )
    off, _ = _generate(MODELS["llama"], 0, params)
    on, llm = _generate(MODELS["llama"], 3, params)
    assert on == off
    assert _metric(llm, "spec_decode_num_drafts_total") > 0


class _MarkovRunner:
    """A model whose next-token distribution depends on the last input token only — a fixed
    table over 6 tokens (no absorbing state), where the n-gram drafter is often right —
    sampled by the shared :class:`resin.sampling.Sampler` at every sampling position."""

    VOCAB = 6

    def __init__(self, stream: int) -> None:
        from resin.runners.torch.layers import sampling_rows
        from resin.sampling import Sampler

        gen = torch.Generator().manual_seed(11)
        self.table = torch.randn(self.VOCAB, self.VOCAB, generator=gen)
        self.sampler = Sampler(self.VOCAB)
        # Unseeded requests draw from the sampler's shared generator: fixed here (a
        # different stream per run), so the test is deterministic, not flaky at 0.1%.
        self.sampler.generator.manual_seed(stream)
        self.sampling_rows = sampling_rows

    def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
        import numpy as np

        self.sampler.begin_step(plan)
        rows, last = self.sampling_rows(plan)
        inputs = torch.as_tensor(plan.input_ids.astype(np.int64))[torch.as_tensor(last)]
        return self.sampler.sample(self.table[inputs], plan, rows)


def test_unseeded_sampling_keeps_the_distribution() -> None:
    """Rejection of point-mass drafts by sampling each position and comparing preserves the
    target distribution: the 8th token's frequencies over 3,000 unseeded requests, with
    speculation off and on, pass a two-sample chi-square test (5 degrees of freedom; the
    statistic must stay below 20.5, the 0.1% critical value), while a planted bias (the same
    test against a runner with a shifted table) fails it."""

    def frequencies(k: int, runner: _MarkovRunner) -> list[int]:
        config = resin.EngineConfig(
            page_size=4,
            num_pages=4096,
            max_num_seqs=256,
            max_model_len=32,
            vocab_size=_MarkovRunner.VOCAB,
            num_speculative_tokens=k,
        )
        engine = resin.Engine(config, runner)
        params = resin.SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
        for i in range(3000):
            engine.add_request(f"r{i}", [1, 2, 1, 2, 1], params)
        counts = [0] * _MarkovRunner.VOCAB
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    counts[out.token_ids[7]] += 1
        if k:
            assert "spec_decode_num_accepted_tokens_total" in engine.metrics_text()
        return counts

    def chi_square(a: list[int], b: list[int]) -> float:
        total_a, total_b = sum(a), sum(b)
        stat = 0.0
        for x, y in zip(a, b, strict=True):
            if x + y == 0:
                continue
            expected_a = (x + y) * total_a / (total_a + total_b)
            expected_b = (x + y) * total_b / (total_a + total_b)
            stat += (x - expected_a) ** 2 / expected_a + (y - expected_b) ** 2 / expected_b
        return stat

    off = frequencies(0, _MarkovRunner(stream=1))
    on = frequencies(3, _MarkovRunner(stream=2))
    assert chi_square(off, on) < 20.5, (off, on)
    biased = _MarkovRunner(stream=3)
    biased.table[:, 0] += 1.0
    assert chi_square(off, frequencies(3, biased)) > 20.5


class _OracleDrafter:
    """A runner with its own drafter (the public interface: ``ForwardOutput.draft_token_ids``
    / ``draft_indptr``): it proposes the tokens a reference run produced next, working out what
    the engine will commit for each row (the agreed prefix plus one) as an MTP head would."""

    def __init__(
        self, inner: object, reference: dict[str, list[int]], k: int, wrong_from: int | None
    ) -> None:
        self.inner, self.reference, self.k, self.wrong_from = inner, reference, k, wrong_from

    def cache_spec(self):  # type: ignore[no-untyped-def]
        return self.inner.cache_spec()

    def bind_cache(self, layout) -> None:  # type: ignore[no-untyped-def]
        self.inner.bind_cache(layout)

    def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
        import numpy as np

        out = self.inner.forward(plan)
        drafts, indptr = [], [0]
        for i, request_id in enumerate(plan.request_ids):
            samples = int(plan.sample_indptr[i + 1] - plan.sample_indptr[i])
            if samples:
                tokens = out.token_ids[out.token_indptr[i] : out.token_indptr[i + 1]].tolist()
                k = int(plan.num_draft_tokens[i])
                row_drafts = plan.input_ids[plan.query_indptr[i + 1] - k : plan.query_indptr[i + 1]]
                agreed = 0
                while agreed < k and tokens[agreed] == row_drafts[agreed]:
                    agreed += 1
                start = int(plan.num_output_tokens[i]) + agreed + 1
                proposal = self.reference[request_id][start : start + self.k]
                if self.wrong_from is not None:  # right up to wrong_from, then off by one
                    proposal = [
                        t if j < self.wrong_from else (t + 1) % 300 for j, t in enumerate(proposal)
                    ]
                drafts += proposal
            indptr.append(len(drafts))
        return resin.ForwardOutput(
            out.token_ids,
            out.token_indptr,
            draft_token_ids=np.array(drafts, np.uint32),
            draft_indptr=np.array(indptr, np.uint32),
        )


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
@pytest.mark.parametrize("wrong_from", [None, 1])
def test_a_runner_drafter_is_verified_like_the_ngram_one(name: str, wrong_from: int | None) -> None:
    """Drafts all right (every one accepted) or right only at position 0 (a partial accept on
    every verify row: for Qwen3-Next, its states restored from the spares each time)."""
    from resin.registry import resolve_runner

    params = resin.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    off, _ = _generate(MODELS[name], 0, params)
    reference = {str(i): tokens for i, tokens in enumerate(off)}
    inner = resolve_runner(MODELS[name], device="cpu", dtype="float32")
    runner = _OracleDrafter(inner, reference, 3, wrong_from)
    llm = LLM(
        MODELS[name], runner=runner, max_num_seqs=4, max_model_len=128, num_speculative_tokens=3
    )
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[str(i)] for i in range(len(PROMPTS))] == off
    drafted = _metric(llm, "spec_decode_num_draft_tokens_total")
    accepted = _metric(llm, "spec_decode_num_accepted_tokens_total")
    rows = _metric(llm, "spec_decode_num_drafts_total")
    assert drafted > 0
    assert accepted == (drafted if wrong_from is None else rows), (accepted, drafted, rows)
    # Per position: every row accepts its first draft; with wrong drafts from position 1 on,
    # none accepts a later one.
    per_pos = [
        _metric_at(llm, "spec_decode_num_accepted_tokens_per_pos_total", i) for i in range(3)
    ]
    assert sum(per_pos) == accepted and per_pos[0] == rows, per_pos
    if wrong_from == 1:
        assert per_pos[1:] == [0, 0]
    else:
        assert per_pos[0] >= per_pos[1] >= per_pos[2] > 0


def test_a_request_that_does_not_speculate_gets_no_drafts() -> None:
    """``SamplingParams(speculate=False)`` (the server's grammar-constrained requests: the
    sampler masks plain rows, not verify rows) decodes one token a row while a request beside
    it verifies drafts; before, n-gram drafts reached such a request and its verify row failed
    the whole plan, every request in it (hostile-client fuzzing)."""
    import numpy as np

    drafted: dict[str, int] = {}

    class Repeating:  # every row's next token repeats its prompt: the drafter is always right
        def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
            ids = list(plan.request_ids)
            for i, rid in enumerate(ids):
                drafted[rid] = drafted.get(rid, 0) + int(plan.num_draft_tokens[i])
            counts = np.maximum(np.diff(plan.sample_indptr.astype(np.int64)), 1)
            tokens = np.full(int(counts.sum()), 7, dtype=np.uint32)
            return resin.ForwardOutput(
                tokens, np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
            )

    config = resin.EngineConfig(
        page_size=4, num_pages=64, max_model_len=64, num_speculative_tokens=3
    )
    engine = resin.Engine(config, Repeating())
    engine.add_request("plain", [7] * 8, resin.SamplingParams(max_tokens=12, temperature=0))
    engine.add_request("no-drafts", [7] * 8, resin.SamplingParams(max_tokens=12, speculate=False))
    while engine.has_unfinished():
        engine.step()
    assert drafted["plain"] > 0 and drafted["no-drafts"] == 0
