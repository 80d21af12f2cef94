"""Tensor parallelism on CPU with gloo: one engine, the plan to every rank, greedy tokens
identical to the single-process run.

Each ``TensorParallelRunner`` spawns N - 1 worker processes (one torch thread each): the
tests run the Llama, Qwen3 (q/k norm) and Qwen3-MoE fixtures at TP = 2 — KV heads split —
and Llama at TP = 4 — 2 KV heads replicated over 4 ranks — under chunked prefill, prefix
hits and preemption; Qwen3-MoE and Mixtral at EP = 2 (alone: attention replicated) and
TP = 2 + EP = 2 (whole experts per rank); check each rank's resident weight and KV bytes are ~1/N of the
single-process runner's; and that a killed rank fails the next step with an error naming it
(no hang), a rank's exception comes back with its traceback, and a size the heads do not
allow is refused before any process starts.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import resin  # noqa: E402
from resin.llm import LLM  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures"
GPT_OSS = Path(__file__).resolve().parents[1] / "resin" / "models" / "gpt_oss" / "tiny"
PROMPTS = [list(range(5, 45)), [7, 8, 9] * 6, [3, 1, 4, 1, 5, 9, 2, 6] * 3 + [5]]
PARAMS = resin.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tp(model: Path, size: int, ep: bool = False, tp: bool = True, **engine: object) -> LLM:
    from resin.runners.parallel import TensorParallelRunner

    runner = TensorParallelRunner(
        model, size, num_threads=1, timeout_s=60, tensor_parallel=tp, expert_parallel=ep
    )
    return LLM(model, runner=runner, **{"max_num_seqs": 3, "max_model_len": 96, **engine})


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("name", ["qwen3"])  # (the others: the strategy matrix below)
def test_tp2_greedy_is_the_single_process_output(name: str) -> None:
    model = FIXTURES / name
    single = LLM(model, max_num_seqs=3, max_model_len=96)
    want = _tokens(single)
    configs: list[dict[str, int]] = [{"num_pages": 200}]
    if name == "llama":  # the engine's side is the same for every model: one model enough
        configs += [
            {"max_num_batched_tokens": 7, "num_pages": 200},  # chunked prefill
            {"page_size": 4, "max_num_batched_tokens": 16, "num_pages": 20, "max_model_len": 64},
        ]
    for engine in configs:
        llm = _tp(model, 2, **engine)
        try:
            assert _tokens(llm) == want, (name, engine)
            if engine["num_pages"] == 200:
                again = llm.generate(PROMPTS, PARAMS)  # prefix hits
                assert [o.token_ids for o in again] == want
                assert sum(o.num_cached_tokens for o in again) > 0
            else:  # a pool of 20 4-token pages for three ~50-token requests: preemption
                assert "resin:num_preemptions_total 0" not in llm.engine.metrics_text()
        finally:
            llm.close()


@pytest.mark.parametrize("name", ["mixtral"])  # (Qwen3-MoE: the strategy matrix below)
@pytest.mark.parametrize("tp", [False, True], ids=["ep2", "tp2_ep2"])
def test_expert_parallel_greedy_is_the_single_process_output(name: str, tp: bool) -> None:
    """EP=2 alone (attention replicated, experts dealt out) and TP=2+EP=2 (attention split,
    whole experts per rank): the single-process tokens; each rank holds half the experts."""
    model = FIXTURES / name
    single = LLM(model, max_num_seqs=3, max_model_len=96)
    want = _tokens(single)
    llm = _tp(model, 2, ep=True, tp=tp, num_pages=200)
    try:
        assert _tokens(llm) == want
        local = llm.runner.local
        experts = [
            t for layer in local.weights.layers for n, t in layer.items() if ".experts." in n
        ]
        whole = [
            t
            for layer in single.runner.weights.layers
            for n, t in layer.items()
            if ".experts." in n
        ]
        held = sum(t.numel() for t in experts)
        assert held * 2 == sum(t.numel() for t in whole)
        assert list(local.shard.local_experts) == list(range(local.shard.num_experts // 2))
    finally:
        llm.close()


def test_each_rank_holds_its_share_of_weights_and_kv() -> None:
    from resin.runners.parallel.tensor_parallel import resident_weight_bytes

    model = FIXTURES / "qwen3_moe"
    single = LLM(model, max_num_seqs=3, max_model_len=96, num_pages=64)
    whole_weights = resident_weight_bytes(single.runner)
    whole_kv = sum(b.numel() * b.element_size() for b in single.runner.slot_buffers)
    llm = _tp(model, 2, num_pages=64)
    try:
        stats = llm.runner.rank_stats()
        assert len(stats) == 2
        norms = sum(  # replicated on every rank: the norms and the routers
            t.numel() * t.element_size()
            for n, t in single.runner.weights.globals.items()
            if "norm" in n
        ) + sum(
            t.numel() * t.element_size()
            for layer in single.runner.weights.layers
            for n, t in layer.items()
            if "norm" in n or n.endswith("gate.weight")
        )
        for rank in stats:
            assert rank["weight_bytes"] == pytest.approx((whole_weights - norms) / 2 + norms)
            assert rank["cache_bytes"] == whole_kv // 2
    finally:
        llm.close()


def test_tp4_replicates_kv_heads() -> None:
    model = FIXTURES / "llama"  # 4 query heads, 2 KV heads: each KV head on two ranks
    want = _tokens(LLM(model, max_num_seqs=3, max_model_len=96))
    llm = _tp(model, 4)
    try:
        assert _tokens(llm) == want
        assert llm.runner.local.shard.local_kv_heads == 1
    finally:
        llm.close()


def test_a_killed_rank_fails_the_next_step_with_its_name() -> None:
    from resin.runners.parallel import RankFailure

    llm = _tp(FIXTURES / "llama", 2)
    try:
        llm.generate(PROMPTS[:1], PARAMS)
        os.kill(llm.runner._procs[0].pid, signal.SIGKILL)
        llm.runner._procs[0].join(10)
        with pytest.raises((RankFailure, resin.StepError), match="rank 1 exited"):
            llm.generate(PROMPTS[:1], PARAMS)
    finally:
        llm.close()


def test_bad_sizes_and_runners_are_refused() -> None:
    from resin.runners.parallel import TensorParallelRunner

    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        TensorParallelRunner(FIXTURES / "llama", 3)
    with pytest.raises(ValueError, match="needs a MoE checkpoint"):
        TensorParallelRunner(FIXTURES / "llama", 2, expert_parallel=True)
    with pytest.raises(ValueError, match="equal sizes"):
        LLM(FIXTURES / "qwen3_moe", tensor_parallel_size=2, expert_parallel_size=4)
    with pytest.raises(NotImplementedError, match="no TENSOR_PARALLEL rules"):
        LLM(GPT_OSS.parents[1] / "qwen3_next" / "tiny", tensor_parallel_size=2)


def test_glm5_flash_shards_by_its_rules() -> None:
    """GLM-5.3-Flash at TP=2 by its weights.TENSOR_PARALLEL: KDA heads split (their
    recurrent states are per rank: linear_num_heads / 2), MLA heads split with the latent and
    the indexer replicated, MoE / dense MLPs by width — the single-process tokens, under
    chunked prefill and prefix hits (recurrent checkpoints) too."""
    glm = GPT_OSS.parents[1] / "glm5_flash" / "tiny"
    want = _tokens(LLM(glm, max_num_seqs=3, max_model_len=96))
    for engine in ({"num_pages": 300},):  # (chunked prefill, preemption: the matrix below)
        llm = LLM(glm, max_num_seqs=3, max_model_len=96, tensor_parallel_size=2, **engine)
        try:
            assert _tokens(llm) == want, engine
            again = llm.generate(PROMPTS, PARAMS)
            assert [o.token_ids for o in again] == want
            assert llm.runner.local.config.linear_num_heads * 2 == 4  # the tiny's 4 heads
        finally:
            llm.close()


def test_deepseek_v4_shards_by_its_rules() -> None:
    """DeepSeek-V4 (resin/models/deepseek_v4_flash) at TP=2 by its weights.TENSOR_PARALLEL:
    query heads and sinks split, the grouped low-rank output by groups (o_groups per rank),
    experts and the shared expert by width; the single K = V head, its compressed caches, the
    compressors, the indexer, hash routing and hyper-connections replicated — the
    single-process tokens on its real caches, under chunked prefill too."""
    deepseek = GPT_OSS.parents[1] / "deepseek_v4_flash" / "tiny"
    want = _tokens(LLM(deepseek, max_num_seqs=3, max_model_len=96))
    for engine in ({},):  # (chunked prefill, prefix hits, preemption: the matrix below)
        llm = LLM(deepseek, max_num_seqs=3, max_model_len=96, tensor_parallel_size=2, **engine)
        try:
            assert _tokens(llm) == want, engine
            assert llm.runner.local.config.o_groups == 1  # 2 groups, one per rank
        finally:
            llm.close()


def test_a_model_directory_shards_by_its_rules() -> None:
    """gpt-oss (resin/models/gpt_oss: sinks, biased attention, fused interleaved experts) on
    two ranks by its weights.TENSOR_PARALLEL: the single-process tokens, under chunked prefill
    too; every parity stage passes (layers included)."""
    from typer.testing import CliRunner

    from resin.cli import app

    want = _tokens(LLM(GPT_OSS, max_num_seqs=3, max_model_len=96))
    for engine in ({},):  # (chunked prefill, prefix hits, preemption: the matrix below)
        llm = LLM(GPT_OSS, max_num_seqs=3, max_model_len=96, tensor_parallel_size=2, **engine)
        try:
            assert type(llm.runner.local).__name__ == "ModelDirRunner"
            assert _tokens(llm) == want, engine
        finally:
            llm.close()
    result = CliRunner().invoke(
        app,
        ["eval", "parity", str(GPT_OSS), "--tensor-parallel-size", "2", "--max-new-tokens", "4"],
    )
    assert result.exit_code == 0, result.output
    assert "[pass] layers" in result.output


@pytest.mark.parametrize(
    "sizes",
    [{"expert_parallel_size": 2}],  # (TP+EP, DP and the engine side: the matrix below)
    ids=["ep2"],
)
def test_gpt_oss_expert_and_data_parallel(sizes: dict[str, int]) -> None:
    """gpt-oss by its weights.EXPERT_PARALLEL: each rank a block of whole experts (fused
    tensors sliced along the experts), the MoE block skipping the others; EP alone, TP+EP and
    DP attention give the single-process tokens."""
    want = _tokens(LLM(GPT_OSS, max_num_seqs=3, max_model_len=96))
    llm = LLM(GPT_OSS, max_num_seqs=3, max_model_len=96, num_pages=200, **sizes)
    try:
        assert _tokens(llm) == want
        if "data_parallel_size" not in sizes:
            local = llm.runner.local
            held = local.weights.layers[0]["mlp.experts.gate_up_proj"].shape[0]
            assert held == 2 and local.shard.local_experts.start == 0
    finally:
        llm.close()


@pytest.mark.parametrize("parallel", [("llama", "tensor"), ("qwen3_moe", "data")])
def test_resin_serve_answers_on_two_ranks(parallel: tuple[str, str]) -> None:
    """The server with tensor_parallel_size 2 or data_parallel_size 2 (what ``resin serve
    --tensor-parallel-size 2`` / ``--data-parallel-size 2`` build): OpenAI and Anthropic
    answers (temperature 0) equal the single-process
    runner's greedy text."""
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    from resin.server.context import ServerOptions
    from resin.server.serve import build_context
    from tests.server_harness import LiveServer

    name, kind = parallel
    model = FIXTURES / name
    messages = [{"role": "user", "content": "Hello there"}]
    expected = LLM(model, max_num_seqs=2, max_model_len=96).chat(
        messages, resin.SamplingParams(max_tokens=8, temperature=0.0)
    )[0]
    ctx = build_context(
        model,
        options=ServerOptions(served_model_names=["tp"]),
        max_num_seqs=2,
        max_model_len=96,
        **{f"{kind}_parallel_size": 2},  # type: ignore[arg-type]
    )
    try:
        assert type(ctx.loop.runner).__name__ == "TensorParallelRunner"
        if kind == "data":
            assert type(ctx.loop.engine).__name__ == "DataParallelEngine"
        with LiveServer(ctx) as live:
            client = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
            chat = client.chat.completions.create(
                model="tp",
                messages=messages,
                max_tokens=8,
                temperature=0,  # type: ignore[arg-type]
            )
            assert chat.choices[0].message.content == expected.text
            claude = anthropic.Anthropic(base_url=live.base_url, api_key="x", max_retries=0)
            message = claude.messages.create(
                model="tp",
                max_tokens=8,
                messages=messages,  # type: ignore[arg-type]
                extra_body={"temperature": 0},  # (this SDK has no temperature argument)
            )
            assert message.content[0].text == expected.text  # type: ignore[union-attr]
    finally:
        ctx.loop.runner.close()


def test_parity_and_bench_take_the_same_flags(tmp_path: Path) -> None:
    """``resin eval parity`` / ``resin bench`` with --tensor-parallel-size (+ EP): every parity
    stage passes on two ranks (the layers stage captured by rank 0: its hidden states after
    each all-reduce are the model's), and bench times the group."""
    import json

    from typer.testing import CliRunner

    from resin.cli import app

    result = CliRunner().invoke(
        app,
        ["eval", "parity", str(FIXTURES / "qwen3_moe"), "--tensor-parallel-size", "2",
         "--expert-parallel-size", "2", "--max-new-tokens", "4"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "parity PASS" in result.output and "[pass] layers" in result.output
    for flags in (["--data-parallel-size", "2"], ["--context-parallel-size", "2"]):
        result = CliRunner().invoke(
            app, ["eval", "parity", str(FIXTURES / "qwen3_moe"), *flags, "--max-new-tokens", "4"]
        )
        assert result.exit_code == 0, (flags, result.output)
        assert "parity PASS" in result.output and "[pass] layers" in result.output
    out = tmp_path / "bench"
    result = CliRunner().invoke(
        app,
        ["bench", str(FIXTURES / "llama"), "--shapes", "decode:2@16 e2e:2@16+4", "--repeats",
         "2", "--warmup", "0", "--num-threads", "1", "--tensor-parallel-size", "2", "--out",
         str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert "--tensor-parallel-size 2" in report["command"]
    assert all(s["tokens_per_s"] > 0 for s in report["shapes"])
    # DP attention: e2e shapes (each rank's engine plans its own requests)
    result = CliRunner().invoke(
        app,
        ["bench", str(FIXTURES / "qwen3_moe"), "--shapes", "e2e:4@16+4", "--repeats", "2",
         "--warmup", "0", "--num-threads", "1", "--data-parallel-size", "2", "--out",
         str(tmp_path / "dp")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "dp" / "report.json").read_text())
    (e2e,) = report["shapes"]
    assert e2e["num_generated"] == 16 and e2e["tokens_per_s"] > 0
    result = CliRunner().invoke(
        app, ["bench", str(FIXTURES / "qwen3_moe"), "--shapes", "decode:2@16",
              "--data-parallel-size", "2", "--out", str(tmp_path / "dp2")],
    )  # fmt: skip
    assert result.exit_code != 0 and "e2e shapes only" in result.output


@pytest.mark.parametrize("name", ["mixtral"])  # (Qwen3-MoE: the strategy matrix below)
def test_dp_attention_greedy_is_the_single_process_output(name: str) -> None:
    """DP attention = 2: two engines (pools, schedulers), a request on one rank for its life,
    the MoE layers exchanging both ranks' tokens; an idle rank (one request in flight) joins
    the exchange with none. Under chunked prefill, prefix hits and preemption."""
    model = FIXTURES / name
    want = _tokens(LLM(model, max_num_seqs=3, max_model_len=96))
    for engine in (
        {"num_pages": 200},
        {"max_num_batched_tokens": 7, "num_pages": 200},
        {"page_size": 4, "max_num_batched_tokens": 16, "num_pages": 17, "max_model_len": 64},
    ):
        llm = LLM(model, data_parallel_size=2, **{"max_num_seqs": 3, "max_model_len": 96, **engine})
        try:
            assert _tokens(llm) == want, engine
            served = [  # both engines served requests (their own prompt tokens)
                re.search(r"^resin:prompt_tokens_total (\S+)", e.metrics_text(), re.M)
                for e in llm.engine.engines
            ]
            assert all(m is not None and float(m.group(1)) > 0 for m in served)
            one = llm.generate(PROMPTS[:1], PARAMS)  # the other rank idles
            assert one[0].token_ids == want[0]
            if engine["num_pages"] == 200:  # PROMPTS[0] ran on engine 0, and so does this
                assert one[0].num_cached_tokens > 0
            else:  # 17 pages per engine for its ~50- and ~35-token requests: preemption
                preemptions = [
                    re.search(r"^resin:num_preemptions_total (\S+)", e.metrics_text(), re.M)
                    for e in llm.engine.engines
                ]
                assert sum(float(m.group(1)) for m in preemptions if m) > 0
        finally:
            llm.close()
        break  # (the engine side: the strategy matrix below)


@pytest.mark.parametrize("model", [FIXTURES / "mistral"], ids=["mistral"])  # gpt-oss: matrix
def test_cp2_with_sliding_windows(model: Path) -> None:
    """CP over sliding-window layers (Mistral; gpt-oss's alternating windows, a model
    directory): a chunk's window is in its cache (every rank writes every key), its page list
    the row's cut at its end — the single-process tokens, under chunked prefill too."""
    want = _tokens(LLM(model, max_num_seqs=3, max_model_len=96))
    for engine in ({}, {"max_num_batched_tokens": 12}):
        llm = LLM(model, context_parallel_size=2, max_num_seqs=3, max_model_len=96, **engine)
        try:
            assert _tokens(llm) == want, engine
        finally:
            llm.close()


STRATEGIES = {
    "tp2": {"tensor_parallel_size": 2},
    "ep2": {"expert_parallel_size": 2},
    "tp2_ep2": {"tensor_parallel_size": 2, "expert_parallel_size": 2},
    "dp2": {"data_parallel_size": 2},
    "cp2": {"context_parallel_size": 2},
}
MATRIX = [
    ("llama", "tp2"),
    ("llama", "cp2"),
    *[
        (m, s)
        for m in ("qwen3_moe", "gpt_oss", "deepseek_v4_flash", "glm5_flash")
        for s in STRATEGIES
    ],
    ("qwen3_next", "cp2"),
]


def _checkpoint(name: str) -> Path:
    return FIXTURES / name if (FIXTURES / name).is_dir() else GPT_OSS.parents[1] / name / "tiny"


def _counter(llm: LLM, name: str) -> float:
    engines = getattr(llm.engine, "engines", [llm.engine])  # DP: one engine per rank
    total = 0.0
    for engine in engines:
        match = re.search(rf"^resin:{name} (\S+)", engine.metrics_text(), re.M)
        total += float(match.group(1)) if match else 0.0
    return total


@pytest.mark.parametrize("name, strategy", MATRIX, ids=[f"{m}-{s}" for m, s in MATRIX])
def test_every_strategy_keeps_the_single_process_tokens(name: str, strategy: str) -> None:
    """Every model in CI under every split it supports (TP=2, EP=2, TP=2+EP=2, DP=2, CP=2):
    greedy tokens identical to the single-process run, under chunked prefill then prefix hits
    (one engine, the same prompts twice), and under preemption (a pool too small for the
    three requests at once)."""
    model = _checkpoint(name)
    want = _tokens(LLM(model, max_num_seqs=3, max_model_len=96))
    sizes = STRATEGIES[strategy]
    llm = LLM(
        model, max_num_seqs=3, max_model_len=96, max_num_batched_tokens=12, num_pages=300, **sizes
    )
    try:
        assert _tokens(llm) == want
        again = llm.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in again] == want
        assert sum(o.num_cached_tokens for o in again) > 0
    finally:
        llm.close()
    spec = LLM(model, max_model_len=56, page_size=4).runner.cache_spec()
    layout = resin.CacheLayout.from_specs(list(spec), 4)
    pages = layout.pages_per_request(56, 16, True) + 1  # one whole request: they take turns
    llm = LLM(
        model, max_num_seqs=3, max_model_len=56, page_size=4, max_num_batched_tokens=16,
        num_pages=pages, **sizes,
    )  # fmt: skip
    try:
        assert _tokens(llm) == want
        assert _counter(llm, "num_preemptions_total") > 0
    finally:
        llm.close()


@pytest.mark.parametrize(
    "name, strategy", [("llama", "tp2"), ("qwen3_moe", "dp2"), ("llama", "cp2")]
)
def test_prompt_logprobs_are_the_single_process_ones(name: str, strategy: str) -> None:
    """Prompt logprobs (every prompt token's, and the top 2) under TP (rank 1 computes its
    logits' collectives too), DP attention (rank 1's rows come back through the pipe) and CP
    (from the all-gathered hidden states), in chunks of 12 tokens."""
    model = FIXTURES / name
    asked = resin.SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    want = LLM(model, max_model_len=96).generate(PROMPTS, asked)
    llm = LLM(model, max_model_len=96, max_num_batched_tokens=12, **STRATEGIES[strategy])
    try:
        got = llm.generate(PROMPTS, asked)
    finally:
        llm.close()
    for ours, single in zip(got, want):
        assert len(ours.prompt_logprobs) == len(single.prompt_logprobs) > 1
        for entry, expected in zip(ours.prompt_logprobs[1:], single.prompt_logprobs[1:]):
            assert entry.keys() == expected.keys()
            assert all(abs(entry[t] - expected[t]) < 1e-4 for t in entry)


def test_tp2_on_an_fp8_checkpoint_is_the_dequantised_output(tmp_path: Path) -> None:
    """A block-scaled FP8 checkpoint under TP: each rank reads a quantised tensor whole with its
    scale, dequantises it and keeps its slice (it used to cast the FP8 codes without their
    scales: silently wrong weights)."""
    from tests.test_checkpoint_errors import fp8_quantised

    quantised, reference = fp8_quantised(FIXTURES / "llama", tmp_path)
    want = [o.token_ids for o in LLM(reference, max_model_len=96).generate(PROMPTS, PARAMS)]
    llm = LLM(quantised, max_model_len=96, tensor_parallel_size=2)
    try:
        assert _tokens(llm) == want
    finally:
        llm.close()
