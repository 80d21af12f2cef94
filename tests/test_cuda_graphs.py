"""CUDA graphs for decode steps (resin/runners/torch/cuda_graphs.py, docs/batch_plan.md
"CUDA-graph padding"):

- the engine's bucket choice through the binding: ``EngineConfig.cuda_graph_batch_sizes``
  (validated), a pure-decode step reports the smallest bucket >= S as
  ``padded_num_sequences`` while every array keeps S rows; mixed steps, batches above every
  bucket and the default (no buckets) are not padded;
- the runner's static-buffer padding path, run eagerly on CPU with the triton backend under
  Triton's interpreter (``capture=False``): a padded decode step gives the unpadded step's
  tokens (full and sliding-window models), writes nothing for padding rows (every cache byte
  unchanged but the real rows' new slots, the null page still zero), and never reads the null
  page as a real row's key (a NaN null page changes no real token); the triton write kernel
  against ``write_slots``; the eager reasons counted;
- eligibility: on CPU (no capture) and with the reference backend the runner stays eager and
  says why;
- plumbing: ``resin.LLM(enforce_eager=, cuda_graph_batch_sizes=)``, ``resin serve`` and
  ``resin bench`` ``--enforce-eager`` / ``--cuda-graph-batch-sizes`` reach the runner and the
  engine;
- on a CUDA GPU only: captured graphs replay (the replay counter grows) and give the eager
  tokens.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import resin

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
# Triton on CPU must be imported under TRITON_INTERPRET=1 (tests/test_triton_backend.py does
# the same): set it for the import; if triton was imported without it earlier in the session,
# the triton tests run in a fresh interpreter instead (test_triton_in_a_fresh_process).
STALE = (
    not GPU
    and "triton.language" in sys.modules
    and type(sys.modules["triton.language"].sum).__name__ != "InterpretedFunction"
)
try:
    if not GPU and "triton.language" not in sys.modules:
        _previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            import triton.language  # noqa: F401
        finally:
            if _previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = _previous
    else:
        import triton.language  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

pytestmark = pytest.mark.usefixtures("one_torch_thread")
triton_here = pytest.mark.skipif(
    STALE or not HAVE_TRITON,
    reason="triton missing, or imported without TRITON_INTERPRET=1 (fresh-process test)",
)
gpu_only = pytest.mark.skipif(not GPU, reason="CUDA graphs capture on a CUDA GPU only")

PROMPTS = [[3, 5, 7], [10, 20, 30, 40, 50], [9, 8, 7, 6, 5, 4, 3], [2, 4, 6, 8]]


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


class _Runner:
    """One token per row; keeps the plans it saw."""

    def __init__(self) -> None:
        self.plans: list[Any] = []

    def forward(self, plan: Any) -> resin.ForwardOutput:
        self.plans.append(
            (plan.num_sequences, plan.num_decode_sequences, plan.padded_num_sequences)
        )
        assert len(plan.seq_lens) == plan.num_sequences == len(plan.query_indptr) - 1
        assert len(plan.slot_mapping[0]) == plan.num_tokens
        n = plan.num_sequences
        return resin.ForwardOutput(
            token_ids=np.full(n, 7, dtype=np.uint32),
            token_indptr=np.arange(n + 1, dtype=np.uint32),
        )


# -- the engine's bucket choice ------------------------------------------------------------


def test_engine_config_takes_and_checks_the_batch_sizes() -> None:
    config = resin.EngineConfig(cuda_graph_batch_sizes=[1, 2, 4, 8])
    assert config.cuda_graph_batch_sizes == [1, 2, 4, 8]
    assert "cuda_graph_batch_sizes=[1, 2, 4, 8]" in repr(config)
    assert resin.EngineConfig().cuda_graph_batch_sizes == []
    for bad in ([4, 2], [0, 1], [2, 2], [-1]):
        with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
            resin.EngineConfig(cuda_graph_batch_sizes=bad)


def _run_engine(buckets: list[int], num_requests: int) -> list[Any]:
    runner = _Runner()
    config = resin.EngineConfig(
        page_size=4, num_pages=64, max_model_len=32, cuda_graph_batch_sizes=buckets
    )
    engine = resin.Engine(config, runner)
    for i in range(num_requests):
        engine.add_request(str(i), PROMPTS[i % len(PROMPTS)], resin.SamplingParams(max_tokens=3))
    while engine.has_unfinished():
        engine.step()
    return runner.plans


def test_decode_steps_report_the_bucket_and_keep_their_rows() -> None:
    # Step 0 prefills all 3 (not padded), then 2 decode steps of 3 rows -> bucket 4.
    assert _run_engine([1, 2, 4, 8], 3) == [(3, 0, 3), (3, 3, 4), (3, 3, 4)]
    assert _run_engine([], 3) == [(3, 0, 3), (3, 3, 3), (3, 3, 3)], "no buckets: no padding"
    assert _run_engine([1, 2], 3) == [(3, 0, 3), (3, 3, 3), (3, 3, 3)], "above every bucket"


def test_a_mixed_step_is_not_padded() -> None:
    runner = _Runner()
    config = resin.EngineConfig(
        page_size=4, num_pages=64, max_model_len=32, cuda_graph_batch_sizes=[4, 8]
    )
    engine = resin.Engine(config, runner)
    engine.add_request("a", PROMPTS[0], resin.SamplingParams(max_tokens=4))
    engine.step()
    engine.add_request("b", PROMPTS[1], resin.SamplingParams(max_tokens=4))
    engine.step()  # a decodes, b prefills
    engine.step()  # both decode
    assert runner.plans == [(1, 0, 1), (2, 1, 2), (2, 2, 4)]


# -- the static-buffer padding path on CPU (triton under the interpreter) -----------------


def _runner(model: str, graphs: bool, sizes: list[int] | None = None) -> tuple[Any, list[int]]:
    from resin.runners.torch import TorchRunner

    runner = TorchRunner.from_pretrained(REPO / model, device=DEVICE, attention_backend="triton")
    if not graphs:
        return runner, []
    got = runner.configure_cuda_graphs(
        sizes or [1, 2, 4, 8], max_num_seqs=8, max_model_len=64, capture=False
    )
    return runner, got


def _engine(runner: Any, sizes: list[int], page_size: int = 4) -> Any:
    config = resin.EngineConfig(
        page_size=page_size,
        num_pages=96,
        max_num_seqs=8,
        max_model_len=64,
        cuda_graph_batch_sizes=sizes,
    )
    return resin.Engine(config, runner)


def _generate(engine: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = resin.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.token_ids)
    return out


@triton_here
@pytest.mark.usefixtures("interpret")
@pytest.mark.parametrize(
    ("model", "prompts"),
    [
        ("tests/fixtures/llama", PROMPTS[:3]),
        # window 32, prompts past it: the sliding group lists only the window's pages
        ("tests/fixtures/mistral", [list(range(1, 38)), list(range(40, 75))]),
    ],
)
def test_triton_padded_decode_gives_the_unpadded_tokens(
    model: str, prompts: list[list[int]]
) -> None:
    eager, _ = _runner(model, graphs=False)
    expected = _generate(_engine(eager, []), prompts, 5)
    padded, sizes = _runner(model, graphs=True)
    assert sizes == [1, 2, 4, 8]
    got = _generate(_engine(padded, sizes), prompts, 5)
    assert got == expected
    stats = padded.cuda_graph_stats()
    assert stats["captured"] is False and stats["disabled"] is None
    assert stats["num_replayed"] == 4, stats  # 4 decode steps at S = 3 (or 2), padded
    assert stats["eager_reasons"] == {"not a pure-decode step": stats["num_eager"]}


def _snapshot(runner: Any) -> list[torch.Tensor]:
    return [buffer.clone() for buffer in runner.slot_buffers]


@triton_here
@pytest.mark.usefixtures("interpret")
def test_triton_padding_rows_write_nothing_and_read_no_real_key() -> None:
    """Lock-step eager and padded engines: at the padded decode step (S = 3 -> 4) only the
    real rows' new slots change, equal to the eager step's bytes; the null page stays zero.
    Then a NaN null page: padding rows read it, the real rows' tokens do not change."""
    eager, _ = _runner("tests/fixtures/llama", graphs=False)
    padded, sizes = _runner("tests/fixtures/llama", graphs=True)
    engines = [_engine(eager, []), _engine(padded, sizes)]
    params = resin.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for engine in engines:
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add_request(str(i), prompt, params)
    for engine in engines:  # the prefill step
        engine.step()
    plans = [engine.schedule() for engine in engines]
    assert (plans[1].num_sequences, plans[1].padded_num_sequences) == (3, 4)
    before = _snapshot(padded)
    outputs = [runner.forward(plan) for runner, plan in zip((eager, padded), plans)]
    assert padded.cuda_graph_stats()["num_replayed"] == 1
    np.testing.assert_array_equal(outputs[1].token_ids, outputs[0].token_ids)
    layer = padded.layer_caches[0]["k"]
    slots = plans[1].slot_mapping[0].astype(np.int64)
    pages, offsets = slots // layer.shape[1], slots % layer.shape[1]
    for index, caches in enumerate(padded.layer_caches):
        for name, cache in caches.items():
            old = _view_like(before, cache, padded)
            changed = (old != cache).reshape(cache.shape[0], cache.shape[1], -1).any(-1)
            written = torch.zeros_like(changed)
            written[pages, offsets] = True
            assert not (changed & ~written).any(), f"layer {index} {name}: a stray write"
            torch.testing.assert_close(
                cache[pages, offsets], eager.layer_caches[index][name][pages, offsets]
            )
    assert all(int(buffer[0].abs().sum()) == 0 for buffer in padded.slot_buffers), "null page"
    for engine, plan, out in zip(engines, plans, outputs):
        engine.update(plan, out)
    # The null page poisoned: the padding row attends to NaN, the real rows never read it.
    for buffer in padded.slot_buffers:
        buffer[0].view(torch.float32).fill_(float("nan"))
    plans = [engine.schedule() for engine in engines]
    outputs = [runner.forward(plan) for runner, plan in zip((eager, padded), plans)]
    assert padded.cuda_graph_stats()["num_replayed"] == 2
    np.testing.assert_array_equal(outputs[1].token_ids, outputs[0].token_ids)


def _view_like(snapshot: list[torch.Tensor], cache: torch.Tensor, runner: Any) -> torch.Tensor:
    """``cache``'s view (a carved slice of one slot buffer) over the same bytes of the
    snapshot of that buffer."""
    for buffer, copy in zip(runner.slot_buffers, snapshot):
        base = buffer.untyped_storage().data_ptr()
        if base <= cache.data_ptr() < base + buffer.numel():
            offset = cache.storage_offset() * cache.element_size()
            view = copy.view(-1)[offset:].view(cache.dtype)
            return view.as_strided(cache.shape, cache.stride())
    raise AssertionError("cache is not a view of a slot buffer")


@triton_here
@pytest.mark.usefixtures("interpret")
def test_triton_write_kernel_matches_write_slots_and_skips_minus_one() -> None:
    from resin.runners.torch.layers import write_slots
    from resin.runners.torch.triton_backend import TritonBackend

    torch.manual_seed(0)
    pages = torch.zeros(6, 4 * 2 * 8 * 4 + 16, dtype=torch.uint8, device=DEVICE)
    k = pages[:, : 4 * 2 * 8 * 4].view(torch.float32).view(6, 4, 2, 8)  # carved, strided
    assert not k.is_contiguous()
    expected = torch.zeros(6, 4, 2, 8, device=DEVICE)
    values = torch.randn(5, 2, 8, device=DEVICE)
    slots = torch.tensor([5, -1, 20, -1, 7], device=DEVICE)
    TritonBackend().write([k], [values], slots)
    keep = slots >= 0
    write_slots(expected, slots[keep], values[keep])
    torch.testing.assert_close(k, expected, rtol=0, atol=0)
    assert int(pages[:, 4 * 2 * 8 * 4 :].sum()) == 0, "the bytes past the view are untouched"


@triton_here
@pytest.mark.usefixtures("interpret")
def test_triton_plans_that_do_not_fit_run_eager() -> None:
    """Batches above the largest size, mixed steps and parity capture run eager (counted)."""
    runner, sizes = _runner("tests/fixtures/llama", graphs=True, sizes=[1, 2])
    engine = _engine(runner, sizes)
    _generate(engine, PROMPTS[:3], 2)  # prefill, then one decode of 3 rows: above 2
    runner.capture = {}
    _generate(engine, PROMPTS[:1], 2)  # prefill, then a decode of 1 row under capture
    runner.capture = None
    _generate(engine, PROMPTS[:2], 2)  # prefill, then a decode at bucket 2: replayed
    stats = runner.cuda_graph_stats()
    assert stats["num_replayed"] == 1
    assert stats["eager_reasons"] == {
        "not a pure-decode step": 3,
        "padded_num_sequences 3 is not a captured batch size": 1,
        "parity capture is on": 1,
    }


@pytest.mark.skipif(not STALE or not HAVE_TRITON, reason="the triton tests run in this process")
def test_triton_in_a_fresh_process() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton", __file__],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


# -- eligibility ---------------------------------------------------------------------------


@pytest.mark.skipif(GPU, reason="on a GPU the runner captures")
def test_on_cpu_the_runner_stays_eager_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    from resin.runners.torch import TorchRunner

    runner = TorchRunner.from_pretrained(REPO / "tests/fixtures/llama")
    with caplog.at_level(logging.INFO, logger="resin.cuda_graphs"):
        assert runner.configure_cuda_graphs(None, max_num_seqs=8, max_model_len=64) == []
    assert runner.cuda_graphs is None and runner.cuda_graph_stats() is None
    assert "not a CUDA device" in caplog.text and "every step runs eager" in caplog.text


def test_a_backend_without_static_metadata_does_not_qualify(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from resin.runners.torch import TorchRunner
    from resin.runners.torch.cuda_graphs import ineligible_reason

    for backend in ("reference", "torch"):
        runner = TorchRunner.from_pretrained(
            REPO / "tests/fixtures/llama", attention_backend=backend
        )
        reason = ineligible_reason(runner, capture=False)
        assert reason is not None and "graph_safe" in reason, reason
        with caplog.at_level(logging.INFO, logger="resin.cuda_graphs"):
            assert runner.configure_cuda_graphs([1, 2], max_num_seqs=4, max_model_len=32) == []


def test_default_batch_sizes() -> None:
    from resin.runners.torch.cuda_graphs import capture_batch_sizes, default_batch_sizes

    assert default_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_batch_sizes(3) == [1, 2, 3]
    assert default_batch_sizes(300)[-3:] == [272, 288, 300]
    assert capture_batch_sizes([8, 2, 2, 64], max_num_seqs=16) == [2, 8]
    with pytest.raises(ValueError, match=">= 1"):
        capture_batch_sizes([0, 2], max_num_seqs=4)


# -- plumbing: LLM, resin serve, resin bench -------------------------------------------------


class _GraphRunner(_Runner):
    """Records configure_cuda_graphs calls and captures whatever it is asked to."""

    def __init__(self) -> None:
        super().__init__()
        self.configured: list[tuple[Any, int, int]] = []

    def configure_cuda_graphs(
        self, batch_sizes: Any, *, max_num_seqs: int, max_model_len: int
    ) -> list[int]:
        self.configured.append((batch_sizes, max_num_seqs, max_model_len))
        return [1, 2, 4] if batch_sizes is None else list(batch_sizes)


def test_llm_passes_the_runners_sizes_to_the_engine() -> None:
    from resin.llm import LLM

    fixture = REPO / "tests/fixtures/llama"
    runner = _GraphRunner()
    llm = LLM(fixture, runner=runner, max_num_seqs=4, max_model_len=64)
    assert runner.configured == [(None, 4, 64)]
    assert llm.engine.config.cuda_graph_batch_sizes == [1, 2, 4]
    runner = _GraphRunner()
    llm = LLM(fixture, runner=runner, max_num_seqs=4, cuda_graph_batch_sizes=[2, 3])
    assert runner.configured[0][0] == [2, 3]
    assert llm.engine.config.cuda_graph_batch_sizes == [2, 3]
    out = llm.generate([[1, 2, 3], [4, 5, 6]], resin.SamplingParams(max_tokens=3))
    assert [o.token_ids for o in out] == [[7, 7, 7]] * 2
    assert (2, 2, 2) in runner.plans, "decode steps of 2 rows at bucket 2"
    runner = _GraphRunner()
    llm = LLM(fixture, runner=runner, enforce_eager=True, cuda_graph_batch_sizes=[2])
    assert runner.configured == [] and llm.engine.config.cuda_graph_batch_sizes == []
    # A runner without graphs: no padding.
    assert LLM(fixture, runner=_Runner()).engine.config.cuda_graph_batch_sizes == []


def test_llm_on_the_default_cpu_runner_is_eager() -> None:
    from resin.llm import LLM

    llm = LLM(REPO / "tests/fixtures/llama", max_num_seqs=4, max_model_len=64)
    assert llm.engine.config.cuda_graph_batch_sizes == [] or GPU


def test_parse_batch_sizes() -> None:
    from resin.llm import parse_batch_sizes

    assert parse_batch_sizes(None) is None
    assert parse_batch_sizes("8,1, 2 4") == [1, 2, 4, 8]
    for bad in ("", "1,x", "0,2", "-1"):
        with pytest.raises(ValueError, match="cuda-graph-batch-sizes"):
            parse_batch_sizes(bad)


def test_serve_flags_reach_the_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    import resin.server.serve as serve_module
    from resin.cli import app

    seen: dict[str, Any] = {}

    def fake_build_context(model: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise ValueError("stop here")

    monkeypatch.setattr(serve_module, "build_context", fake_build_context)
    fixture = str(REPO / "tests/fixtures/llama")
    args = ["serve", fixture, "--enforce-eager", "--cuda-graph-batch-sizes", "4,1,2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "stop here" in result.output
    assert seen["enforce_eager"] is True and seen["cuda_graph_batch_sizes"] == [1, 2, 4]
    seen.clear()
    CliRunner().invoke(app, ["serve", fixture])
    assert "enforce_eager" not in seen and "cuda_graph_batch_sizes" not in seen
    result = CliRunner().invoke(app, ["serve", fixture, "--cuda-graph-batch-sizes", "1,a"])
    assert result.exit_code == 2 and "positive integers" in result.output
    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    assert "--enforce-eager" in help_text and "--cuda-graph-batch-sizes" in help_text


def test_bench_flags_reach_the_settings_and_the_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    import resin.evals.perf as perf
    from resin.cli import app
    from resin.evals.perf_measure import ShapeRunner
    from resin.evals.perf_shapes import parse_shapes

    seen: list[Any] = []

    def fake_run_bench(model: str, settings: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(settings)
        raise RuntimeError("stop here")

    monkeypatch.setattr(perf, "run_bench", fake_run_bench)
    fixture = str(REPO / "tests/fixtures/llama")
    base = ["bench", fixture, "--shapes", "decode:2@8", "--device", "cpu"]
    result = CliRunner().invoke(app, [*base, "--cuda-graph-batch-sizes", "2,1"])
    assert result.exit_code == perf.EXIT_FAILED, result.output
    assert seen[-1].cuda_graph_batch_sizes == [1, 2] and seen[-1].enforce_eager is False
    CliRunner().invoke(app, [*base, "--enforce-eager"])
    assert seen[-1].enforce_eager is True and seen[-1].cuda_graph_batch_sizes is None
    result = CliRunner().invoke(app, [*base, "--cuda-graph-batch-sizes", "zero"])
    assert result.exit_code == perf.EXIT_USAGE and "positive integers" in result.output

    # What run_bench does with them: the runner is configured for the largest shape, and
    # every shape's engine pads to what it captured.
    runner = _GraphRunner()
    shapes = parse_shapes("decode:2,8@16 prefill:32")
    settings = perf.BenchSettings(
        shapes, 2, 1, 0.1, "cpu", "float32", None, cuda_graph_batch_sizes=[2, 8]
    )
    assert perf._cuda_graph_sizes(runner, settings, shapes) == [2, 8]
    assert runner.configured[0][:2] == ([2, 8], 8)
    settings.enforce_eager = True
    assert perf._cuda_graph_sizes(runner, settings, shapes) == []
    measurer = ShapeRunner(
        runner, SimpleNamespace(vocab_size=64), "cpu", 4, cuda_graph_batch_sizes=[2, 8]
    )
    assert measurer._engine(4, 64, 64).config.cuda_graph_batch_sizes == [2, 8]


# -- on a CUDA GPU -------------------------------------------------------------------------


@gpu_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["tests/fixtures/llama", "tests/fixtures/mistral"])
def test_gpu_replay_gives_the_static_path_tokens(model: str, dtype: str) -> None:
    """Replayed graphs against the same static-buffer path run eagerly (same shapes, same
    kernels: the same tokens in any dtype) and, in fp32, against the unpadded eager run."""
    from resin.runners.torch import TorchRunner

    prompts = [[3, 5, 7], list(range(1, 40)), [9, 8, 7, 6, 5]]  # 3 rows: bucket 4
    outputs, stats = {}, {}
    for mode in ("eager", "static", "replay"):
        runner = TorchRunner.from_pretrained(
            REPO / model, device="cuda", dtype=getattr(torch, dtype), attention_backend="triton"
        )
        sizes = []
        if mode != "eager":
            sizes = runner.configure_cuda_graphs(
                [1, 2, 4, 8], max_num_seqs=8, max_model_len=64, capture=mode == "replay"
            )
        outputs[mode] = _generate(_engine(runner, sizes, page_size=16), prompts, 12)
        stats[mode] = runner.cuda_graph_stats()
    assert stats["replay"]["captured"] is True, stats["replay"]
    assert stats["replay"]["num_replayed"] == stats["static"]["num_replayed"] == 11, stats
    assert outputs["replay"] == outputs["static"]
    if dtype == "float32":
        assert outputs["replay"] == outputs["eager"]


@gpu_only
def test_gpu_llm_captures_by_default_and_counts_replays() -> None:
    from resin.llm import LLM

    prompts = [[3, 5, 7], list(range(1, 40)), [9, 8, 7, 6, 5], [2, 4, 6]]
    params = resin.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    common: dict[str, Any] = dict(
        device="cuda", attention_backend="triton", max_num_seqs=8, kv_cache_bytes=64 << 20
    )
    eager = LLM(REPO / "tests/fixtures/llama", enforce_eager=True, **common)
    assert eager.engine.config.cuda_graph_batch_sizes == []
    assert eager.runner.cuda_graph_stats() is None
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    llm = LLM(REPO / "tests/fixtures/llama", **common)
    assert llm.engine.config.cuda_graph_batch_sizes == [1, 2, 4, 8]
    assert llm.runner.cuda_graph_stats()["captured"] is True
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    after = llm.runner.cuda_graph_stats()
    assert after["num_replayed"] == 11, after  # 11 decode steps of 4 rows
    again = [o.token_ids for o in llm.generate(prompts[:3], params)]  # 3 rows at bucket 4
    assert again == expected[:3]
    assert llm.runner.cuda_graph_stats()["num_replayed"] == 22


@gpu_only
def test_gpu_a_model_that_cannot_be_captured_runs_eager() -> None:
    """The loop-over-experts MoE synchronises with the host: capture fails, graphs go off for
    the runner (logged), and every step runs eager with the same tokens."""
    from resin.llm import LLM

    prompts = [[3, 5, 7], [9, 8, 7, 6, 5]]
    params = resin.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    common: dict[str, Any] = dict(
        device="cuda", attention_backend="triton", max_num_seqs=4, kv_cache_bytes=64 << 20
    )
    model = REPO / "tests/fixtures/qwen3_moe"
    eager = LLM(model, enforce_eager=True, **common)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    llm = LLM(model, **common)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.runner.cuda_graph_stats()
    assert stats["captured"] or stats["disabled"], stats
