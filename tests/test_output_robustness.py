"""Runner output and config edge cases found in review: each must end in a clear error (or
work) and leave the engine serving — never a panic, a stuck plan, a hang or a leak."""

import gc
import threading
import weakref

import numpy as np
import pytest

import resin


class OneTokenRunner:
    def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
        n = plan.num_sequences
        return resin.ForwardOutput(np.zeros(n, np.uint32), np.arange(n + 1, dtype=np.uint32))


def unaligned_u32(values: list[int]) -> np.ndarray:
    raw = np.zeros(4 * len(values) + 1, np.uint8)[1:]
    array = raw.view(np.uint32)
    array[:] = values
    assert not array.flags.aligned and array.flags.c_contiguous
    return array


@pytest.mark.parametrize("field", ["token_ids", "token_indptr"])
def test_unaligned_output_array_is_a_value_error_and_the_engine_keeps_serving(field: str) -> None:
    class UnalignedOnce(OneTokenRunner):
        calls = 0

        def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
            self.calls += 1
            out = super().forward(plan)
            if self.calls > 1:
                return out
            ids, indptr = np.asarray(out.token_ids), np.asarray(out.token_indptr)
            if field == "token_ids":
                return resin.ForwardOutput(unaligned_u32(ids.tolist()), indptr)
            return resin.ForwardOutput(ids, unaligned_u32(indptr.tolist()))

    engine = resin.Engine(
        resin.EngineConfig(page_size=4, num_pages=32, max_model_len=32), UnalignedOnce()
    )
    engine.add_request("a", [1, 2, 3], resin.SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=f"ForwardOutput.{field} must be C-contiguous and aligned"):
        engine.step()
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].finish_reason == "length" and outputs[-1].token_ids == [0, 0]


def test_top_logprob_ids_are_checked_against_the_vocabulary() -> None:
    engine = resin.Engine(
        resin.EngineConfig(page_size=4, num_pages=32, max_model_len=32, vocab_size=10),
        OneTokenRunner(),
    )
    engine.add_request("a", [1, 2], resin.SamplingParams(max_tokens=1, logprobs=1))
    plan = engine.schedule()
    bad = resin.ForwardOutput(
        np.array([3], np.uint32),
        np.array([0, 1], np.uint32),
        np.array([-0.1], np.float32),
        np.array([[11]], np.uint32),
        np.array([[-0.2]], np.float32),
    )
    with pytest.raises(ValueError, match="top_logprob_ids"):
        engine.update(plan, bad)
    good = resin.ForwardOutput(
        np.array([3], np.uint32),
        np.array([0, 1], np.uint32),
        np.array([-0.1], np.float32),
        np.array([[4]], np.uint32),
        np.array([[-0.2]], np.float32),
    )
    (out,) = engine.update(plan, good)
    assert out.logprobs is not None and out.logprobs[0] == pytest.approx({3: -0.1, 4: -0.2})


def test_window_plus_budget_past_u32_does_not_wrap_into_a_too_small_pool() -> None:
    class Windowed(OneTokenRunner):
        def cache_spec(self) -> list[resin.LayerCacheSpec]:
            return [resin.LayerCacheSpec.sliding_window(4096, 64)]

    config = resin.EngineConfig(
        page_size=16, num_pages=300, max_model_len=8192, max_num_batched_tokens=2**32 - 1
    )
    with pytest.raises(ValueError, match="num_pages = 300 is too small"):
        resin.Engine(config, Windowed())


def test_huge_sizes_are_errors_or_harmless_not_aborts() -> None:
    with pytest.raises(ValueError, match="num_pages"):
        resin.Engine(resin.EngineConfig(num_pages=2**31, max_model_len=64), OneTokenRunner())
    # More sequences than pages can never run at once; the slot table is sized to the pool.
    engine = resin.Engine(
        resin.EngineConfig(page_size=4, num_pages=16, max_model_len=16, max_num_seqs=2**32 - 1),
        OneTokenRunner(),
    )
    for i in range(20):
        engine.add_request(f"r{i}", [1, 2, 3], resin.SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert engine.num_free_pages == 15


def test_an_engine_and_a_runner_that_holds_it_are_collected() -> None:
    class SelfAware(OneTokenRunner):
        engine: resin.Engine

    runner = SelfAware()
    runner.engine = resin.Engine(
        resin.EngineConfig(page_size=4, num_pages=16, max_model_len=16), runner
    )
    alive = weakref.ref(runner)
    del runner
    gc.collect()
    assert alive() is None


def test_prefix_metrics_stay_zero_with_prefix_caching_off() -> None:
    engine = resin.Engine(
        resin.EngineConfig(
            page_size=4, num_pages=32, max_model_len=32, enable_prefix_caching=False
        ),
        OneTokenRunner(),
    )
    for rid in ("a", "b"):
        engine.add_request(rid, [1, 2, 3, 4, 5, 6], resin.SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    text = engine.metrics_text()
    assert (
        "resin:prefix_cache_queries_total 0\n" in text
        and "resin:prefix_cache_hits_total 0\n" in text
    )


def test_a_failed_step_discards_only_its_own_plan() -> None:
    """Thread A's forward fails after thread B replaced the pending plan: B's plan survives."""
    entered, release = threading.Event(), threading.Event()

    class Blocking(OneTokenRunner):
        def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
            entered.set()
            release.wait(10)
            raise RuntimeError("runner failed")

    engine = resin.Engine(
        resin.EngineConfig(page_size=4, num_pages=32, max_model_len=32), Blocking()
    )
    engine.add_request("a", [1, 2, 3], resin.SamplingParams(max_tokens=2))
    errors: list[BaseException] = []

    def step() -> None:
        try:
            engine.step()
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=step)
    thread.start()
    assert entered.wait(10)
    engine.discard_plan()
    replacement = engine.schedule()
    release.set()
    thread.join(10)
    assert [str(e) for e in errors] == ["runner failed"]
    (out,) = engine.update(replacement, OneTokenRunner().forward(replacement))
    assert out.new_token_ids == [0]
