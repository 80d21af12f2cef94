"""Timing one shape through a real :class:`resin.Engine`: the measurement loops of ``resin bench``.

Owns how a shape (:class:`resin.evals.perf_shapes.Shape`) becomes timed engine steps. Every
timed plan is a real plan the engine built; nothing is synthesised:

* ``decode:B@C`` — a fresh engine (prefix caching off, ``max_num_seqs = B``) gets B requests
  with C random prompt tokens each and steps (untimed) until a plan has all B rows decoding.
  From then on every step is a full decode step; ``warmup`` of them are untimed, then
  ``repeats`` are timed. Repeat r runs at context ``C + r``.
* ``prefill:N`` — per repeat, one request of N prompt tokens with ``max_tokens = 1`` in an engine
  whose token budget is N, so its one plan is a single N-token chunk from an empty cache.
* ``e2e:B@P+O`` — per repeat, B requests of P prompt tokens generating O tokens each, stepped
  from an idle engine until all finish; the sample is the wall time of the whole run. With
  speculative decoding (``num_speculative_tokens`` > 0: the engine's n-gram drafter, or the
  runner's own when it drafts, e.g. MTP) the run also counts verify rows, drafts and accepted
  drafts (the engine's ``spec_decode_*`` counters) and its steps: the mean acceptance length
  is ``1 + accepted / verify rows`` (vLLM's definition), tokens per step ``B·O / steps``.

With CUDA graphs (``cuda_graph_batch_sizes``: what the runner captured) every engine pads its
pure-decode steps to them and the runner replays; each new engine re-captures (``bind_cache``),
untimed.

Each step is driven as ``schedule() -> runner.forward(plan) -> update(plan, output)`` with the
three parts timed separately: the runner's step time (``forward``) and the engine overhead
(``schedule + update``, a host-side cost). On CPU ``time.perf_counter`` times the forward; on
CUDA ``torch.cuda.Event`` pairs after a ``torch.cuda.synchronize()``. Sampling is greedy and
EOS is ignored, so every request runs its full length.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from resin._core import BatchPlan, CacheLayout, Engine, EngineConfig, SamplingParams
from resin.evals.perf_shapes import Shape
from resin.evals.roofline import ZERO_COST, ModelDims, StepCost, plan_cost

PAGE_SIZE = 16
MAX_UNTIMED_STEPS = 100_000  # guard against an engine that never reaches the wanted plan


@dataclass
class Stats:
    """Summary of timing samples, in seconds. ``spread_s`` = (p90 - p10) / 2, the noise
    estimate regressions are judged against; ``noise_frac`` = spread_s / median_s."""

    median_s: float
    p10_s: float
    p90_s: float
    min_s: float
    max_s: float
    spread_s: float
    noise_frac: float
    num_samples: int

    @classmethod
    def of(cls, samples_s: list[float]) -> Stats:
        if not samples_s:
            raise ValueError("no timing samples")
        a = np.asarray(samples_s, dtype=np.float64)
        p10, median, p90 = (float(x) for x in np.percentile(a, [10, 50, 90]))
        spread = (p90 - p10) / 2
        return cls(
            median,
            p10,
            p90,
            float(a.min()),
            float(a.max()),
            spread,
            spread / median if median > 0 else 0.0,
            len(samples_s),
        )


@dataclass
class ShapeTiming:
    """Raw samples of one shape. Per timed step (or per e2e run): ``samples_s`` (decode and
    prefill: the runner's forward; e2e: the whole run's wall time), ``schedule_s``,
    ``update_s``, ``step_wall_s`` (schedule + forward + update). ``cost``: FLOPs/bytes of one
    timed step (e2e: of one whole run); ``num_tokens``: tokens per sample; ``num_generated``:
    tokens sampled per sample."""

    shape: Shape
    samples_s: list[float] = field(default_factory=list)
    schedule_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    step_wall_s: list[float] = field(default_factory=list)
    cost: StepCost = ZERO_COST
    num_tokens: int = 0
    num_generated: int = 0
    num_steps_per_sample: int = 1
    mean_context_len: float = 0.0  # tokens cached per row at the first timed step
    roofline_parts: list[StepCost] = field(default_factory=list)  # e2e: per step of one run
    # e2e with speculative decoding, one run: verify rows, their drafts, the drafts accepted.
    spec_decode: dict[str, int] | None = None


class ForwardTimer:
    """Times ``runner.forward(plan)``: ``perf_counter`` on CPU, CUDA events on CUDA."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        if self.cuda:
            import torch

            self._torch = torch

    def __call__(self, forward: Callable[[BatchPlan], Any], plan: BatchPlan) -> tuple[Any, float]:
        if not self.cuda:
            start = time.perf_counter()
            output = forward(plan)
            return output, time.perf_counter() - start
        torch = self._torch
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        output = forward(plan)
        end.record()
        end.synchronize()
        return output, start.elapsed_time(end) / 1e3


@dataclass
class Step:
    """One driven engine step: its plan, the three timed parts (seconds) and update's outputs
    (``plans``: every plan of the step — DP attention runs one per rank)."""

    plan: BatchPlan
    schedule_s: float
    forward_s: float
    update_s: float
    outputs: list[Any]
    plans: list[BatchPlan] = field(default_factory=list)


def drive_step(engine: Engine, runner: Any, timer: ForwardTimer) -> Step:
    """One engine step as schedule -> forward -> update, each part timed. DP attention
    (:class:`resin.runners.parallel.data_parallel.DataParallelEngine`): every rank's engine
    schedules, one group forward runs all the plans, every engine commits."""
    engines = getattr(engine, "engines", None)
    if engines is not None:
        t0 = time.perf_counter()
        plans = [e.schedule() for e in engines]
        schedule_s = time.perf_counter() - t0
        outputs, forward_s = timer(lambda _: runner.forward_all(plans), plans[0])
        t1 = time.perf_counter()
        results = [out for e, p, o in zip(engines, plans, outputs) for out in e.update(p, o)]
        return Step(plans[0], schedule_s, forward_s, time.perf_counter() - t1, results, plans)
    t0 = time.perf_counter()
    plan = engine.schedule()
    schedule_s = time.perf_counter() - t0
    output, forward_s = timer(runner.forward, plan)
    t1 = time.perf_counter()
    outputs = engine.update(plan, output)
    return Step(plan, schedule_s, forward_s, time.perf_counter() - t1, outputs, [plan])


class ShapeRunner:
    """Measures shapes on one loaded runner; a fresh engine per shape (sized for it)."""

    def __init__(
        self,
        runner: Any,
        config: ModelDims,
        device: str,
        dtype_bytes: int,
        seed: int = 0,
        num_speculative_tokens: int = 0,
        cuda_graph_batch_sizes: list[int] | None = None,
    ):
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens
        # The batch sizes the runner captured (PagedRunner.configure_cuda_graphs): each
        # shape's engine pads its decode steps to them.
        self.cuda_graph_batch_sizes = list(cuda_graph_batch_sizes or [])
        self.config = config
        self.timer = ForwardTimer(device)
        self.dtype_bytes = dtype_bytes
        self.rng = np.random.default_rng(seed)
        self._next_id = 0

    def measure(self, shape: Shape, repeats: int, warmup: int) -> ShapeTiming:
        if getattr(self.runner, "data_parallel", False) and shape.kind != "e2e":
            raise ValueError(
                f"{shape.id}: under DP attention the ranks' plans differ, so resin bench times "
                "e2e shapes only (e2e:B@P+O)"
            )
        if shape.kind == "decode":
            return self._decode(shape, repeats, warmup)
        if shape.kind == "prefill":
            return self._prefill(shape, repeats, warmup)
        return self._e2e(shape, repeats, warmup)

    # -- helpers ---------------------------------------------------------------------------
    def _engine(self, max_num_seqs: int, max_len: int, budget_tokens: int) -> Engine:
        # Every request at full length in every cache group: the engine's own rule.
        specs = self.runner.cache_spec() if hasattr(self.runner, "cache_spec") else []
        layout = CacheLayout.from_specs(list(specs), PAGE_SIZE)
        pages_per_seq = layout.pages_per_request(
            max_len, budget_tokens, False, self.num_speculative_tokens
        )
        config = EngineConfig(
            page_size=PAGE_SIZE,
            num_pages=1 + max_num_seqs * pages_per_seq,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget_tokens,
            max_model_len=max_len,
            enable_prefix_caching=False,
            eos_token_ids=[],
            vocab_size=self.config.vocab_size,
            num_speculative_tokens=self.num_speculative_tokens,
            cuda_graph_batch_sizes=self.cuda_graph_batch_sizes,
        )
        if getattr(self.runner, "data_parallel", False):
            from resin.runners.parallel.data_parallel import DataParallelEngine

            return DataParallelEngine(config, self.runner)  # type: ignore[return-value]
        return Engine(config, self.runner)

    def _add(self, engine: Engine, num_prompt_tokens: int, max_tokens: int) -> str:
        request_id = f"bench-{self._next_id}"
        self._next_id += 1
        prompt = self.rng.integers(0, self.config.vocab_size, num_prompt_tokens).tolist()
        engine.add_request(
            request_id,
            prompt,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
        )
        return request_id

    def _record(self, timing: ShapeTiming, step: Step) -> None:
        timing.samples_s.append(step.forward_s)
        timing.schedule_s.append(step.schedule_s)
        timing.update_s.append(step.update_s)
        timing.step_wall_s.append(step.schedule_s + step.forward_s + step.update_s)

    # -- shapes ----------------------------------------------------------------------------
    def _decode(self, shape: Shape, repeats: int, warmup: int) -> ShapeTiming:
        b = shape.batch_size
        num_decode_steps = warmup + repeats
        budget_tokens = max(2048, b, min(b * shape.context_len, 16384))
        # Rows that finish prefill early decode while the others prefill: give every request
        # enough output tokens to still be running when the last one starts decoding.
        max_tokens = num_decode_steps + math.ceil(b * shape.context_len / budget_tokens) + 2
        engine = self._engine(b, shape.context_len + max_tokens, budget_tokens)
        for _ in range(b):
            self._add(engine, shape.context_len, max_tokens)
        timing = ShapeTiming(shape, num_tokens=b, num_generated=b)
        num_full = 0
        for _ in range(MAX_UNTIMED_STEPS):
            step = drive_step(engine, self.runner, self.timer)
            plan = step.plan
            if plan.num_sequences != b or plan.num_decode_sequences != b:
                continue
            num_full += 1
            if num_full == warmup + 1:  # the first timed step fixes the cost
                timing.cost = plan_cost(self.config, plan, self.dtype_bytes)
                timing.mean_context_len = float(np.mean(plan.num_computed_tokens))
            if num_full > warmup:
                self._record(timing, step)
            if num_full == num_decode_steps:
                break
        else:
            raise RuntimeError(f"{shape.id}: the engine never scheduled {b} decode rows together")
        return timing

    def _prefill(self, shape: Shape, repeats: int, warmup: int) -> ShapeTiming:
        n = shape.num_tokens
        engine = self._engine(1, n + 1, n)
        timing = ShapeTiming(shape, num_tokens=n, num_generated=1)
        for index in range(warmup + repeats):
            self._add(engine, n, 1)
            step = drive_step(engine, self.runner, self.timer)
            if step.plan.num_tokens != n or not any(o.finished for o in step.outputs):
                raise RuntimeError(
                    f"{shape.id}: expected one {n}-token chunk that finishes the "
                    f"request, got a plan of {step.plan.num_tokens} tokens"
                )
            if index == warmup:
                timing.cost = plan_cost(self.config, step.plan, self.dtype_bytes)
            if index >= warmup:
                self._record(timing, step)
        return timing

    def _e2e(self, shape: Shape, repeats: int, warmup: int) -> ShapeTiming:
        b, p, o = shape.batch_size, shape.context_len, shape.num_output_tokens
        engine = self._engine(b, p + o + 1, max(2048, p))
        timing = ShapeTiming(shape, num_tokens=b * (p + o), num_generated=b * o)
        for index in range(min(warmup, 1) + repeats):  # one warm-up run is plenty
            ids = {self._add(engine, p, o) for _ in range(b)}
            before = _spec_counters(engine)
            parts = [0.0, 0.0, 0.0]
            costs: list[StepCost] = []
            started = time.perf_counter()
            for _ in range(MAX_UNTIMED_STEPS):
                step = drive_step(engine, self.runner, self.timer)
                parts[0] += step.schedule_s
                parts[1] += step.forward_s
                parts[2] += step.update_s
                costs.append(
                    sum(
                        (plan_cost(self.config, p, self.dtype_bytes) for p in step.plans),
                        ZERO_COST,
                    )
                )
                ids -= {out.request_id for out in step.outputs if out.finished}
                if not ids:
                    break
            else:
                raise RuntimeError(f"{shape.id}: requests did not finish")
            wall_s = time.perf_counter() - started
            if index < min(warmup, 1):
                continue
            timing.samples_s.append(wall_s)
            timing.schedule_s.append(parts[0])
            timing.update_s.append(parts[2])
            timing.step_wall_s.append(wall_s)
            timing.num_steps_per_sample = len(costs)
            timing.roofline_parts = costs
            timing.cost = sum(costs, ZERO_COST)
            if self.num_speculative_tokens:
                after = _spec_counters(engine)
                timing.spec_decode = {k: after[k] - before[k] for k in after}
        return timing


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _spec_counters(engine: Engine) -> dict[str, int]:
    """The engine's ``spec_decode_*`` counters now (from its Prometheus text)."""
    values = {}
    for line in engine.metrics_text().splitlines():
        for name in SPEC_COUNTERS:
            if line.startswith(f"resin:spec_decode_{name}_total "):
                values[name] = int(float(line.split()[1]))
    return values
