"""Plan memory: numpy views borrow the plan's Rust memory and free it with the last view.

A view's base object must not be the BatchPlan that caches the view, or every plan whose
arrays were read would live forever (numpy arrays are invisible to the cycle collector).
"""

import gc

import numpy as np

import resin


class TouchingRunner:
    """Reads every array a real runner reads, keeping none of them."""

    def forward(self, plan: resin.BatchPlan) -> resin.ForwardOutput:
        _ = (plan.input_ids, plan.positions, plan.kv_indices[0], plan.slot_mapping[0])
        _ = (plan.block_table[0], plan.sampling.temperature, plan.request_ids)
        n = plan.num_sequences
        return resin.ForwardOutput(np.zeros(n, np.uint32), np.arange(n + 1, dtype=np.uint32))


def live_plans() -> int:
    gc.collect()
    return sum(type(o) is resin.BatchPlan for o in gc.get_objects())


def test_plans_whose_arrays_were_read_are_freed() -> None:
    engine = resin.Engine(
        resin.EngineConfig(page_size=4, num_pages=256, max_model_len=64), TouchingRunner()
    )
    for i in range(8):
        engine.add_request(
            f"r{i}", list(range(1, 20)), resin.SamplingParams(max_tokens=30, ignore_eos=True)
        )
    before = live_plans()
    for _ in range(40):
        engine.step()
    assert live_plans() == before


def test_a_view_outlives_its_plan() -> None:
    engine = resin.Engine(
        resin.EngineConfig(page_size=4, num_pages=64, max_model_len=32), TouchingRunner()
    )
    engine.add_request("a", [5, 6, 7], resin.SamplingParams(max_tokens=2))
    plan = engine.schedule()
    ids = plan.input_ids
    pages = plan.kv_indices[0]
    del plan
    gc.collect()
    assert ids.tolist() == [5, 6, 7]
    assert pages.tolist() == [1]
    assert not ids.flags.writeable and ids.base is not None


def test_request_outputs_stay_out_of_the_cyclic_gc() -> None:
    """RequestOutputs hold no Python references, so the engine untracks them: a large step's
    thousand outputs then cost the cycle collector nothing. Their data stays readable."""
    engine = resin.Engine(
        resin.EngineConfig(page_size=4, num_pages=64, max_model_len=32), TouchingRunner()
    )
    engine.add_request("a", [1, 2, 3], resin.SamplingParams(max_tokens=2, logprobs=None))
    outs = engine.step()
    assert [gc.is_tracked(o) for o in outs] == [False]
    gc.collect()
    assert outs[0].token_ids == [0] and outs[0].prompt_token_ids == [1, 2, 3]
