"""DP attention: D attention replicas, each with its own engine-side request partition, the MoE
layers shared by all ranks.

Owns :class:`DataParallelEngine`, what :class:`resin.LLM` drives in place of one
:class:`resin.Engine` when ``data_parallel_size`` D > 1: D engines — one per rank, each with
its own scheduler and page pool (the rank's KV cache holds only its requests) — over one
:class:`~.launcher.TensorParallelRunner` group in DP mode (attention and dense layers
replicated, experts dealt over the ranks, the MoE layers exchanging every rank's tokens).

A request goes to the engine with the fewest unfinished requests and stays there (its pages
are on that rank). Each step every engine schedules; all D plans run together
(:meth:`~.launcher.TensorParallelRunner.forward_all`) — an engine with nothing to do hands
its rank an empty plan, which still runs every layer so the MoE collectives line up (SGLang's
idle batches) — and each engine commits its own rank's output. ``/metrics`` sums the
engines' series. Imports torch.
"""

from __future__ import annotations

from typing import Any, Literal

from resin._core import BatchPlan, CacheLayout, Engine, EngineConfig, ForwardOutput, RequestOutput


class _RankRunner:
    """What one rank's engine sees: that rank's cache spec and binding. Its forward is run by
    :meth:`DataParallelEngine.step` for all ranks at once."""

    def __init__(self, group: Any, rank: int):
        self.group = group
        self.rank = rank

    def cache_spec(self) -> Any:
        return self.group.cache_spec()  # every rank holds the same model

    def bind_cache(self, layout: CacheLayout) -> None:
        self.group.bind_rank(self.rank, layout)

    def forward(self, plan: BatchPlan) -> ForwardOutput:
        raise RuntimeError("a data-parallel rank's forward runs in DataParallelEngine.step")


class DataParallelEngine:
    """D engines over one DP-attention group (see the module doc). The subset of
    :class:`resin.Engine`'s interface :class:`resin.LLM` uses."""

    def __init__(self, config: EngineConfig, group: Any):
        if not getattr(group, "data_parallel", False):
            raise ValueError("DataParallelEngine needs a runner group started in DP mode")
        self.group = group
        self.engines = [Engine(config, _RankRunner(group, r)) for r in range(group.world_size)]
        self.owner: dict[str, int] = {}
        self._num_forward_calls = 0

    @property
    def num_forward_calls(self) -> int:
        """Steps that ran any rank's rows (all-idle steps only commit lifecycle notices)."""
        return self._num_forward_calls

    @property
    def config(self) -> EngineConfig:
        return self.engines[0].config

    @property
    def runner(self) -> Any:
        return self.group

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        if request_id in self.owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        load = [e.num_waiting + e.num_running for e in self.engines]
        rank = load.index(min(load))
        self.engines[rank].add_request(request_id, prompt_token_ids, params)
        self.owner[request_id] = rank

    def abort(self, request_id: str, finish_reason: Literal["abort", "stop"] = "abort") -> bool:
        rank = self.owner.get(request_id)
        return rank is not None and self.engines[rank].abort(request_id, finish_reason)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    @property
    def num_waiting(self) -> int:
        return sum(e.num_waiting for e in self.engines)

    @property
    def num_running(self) -> int:
        return sum(e.num_running for e in self.engines)

    def step(self) -> list[RequestOutput]:
        """One step of every engine: D plans, one group forward, D commits."""
        plans = [e.schedule() for e in self.engines]
        try:
            outputs = self.group.forward_all(plans)
        except BaseException:
            for engine in self.engines:  # nothing committed; the same work plans again
                engine.discard_plan()
            raise
        if any(plan.num_sequences for plan in plans):
            self._num_forward_calls += 1
        results: list[RequestOutput] = []
        for engine, plan, output in zip(self.engines, plans, outputs):
            results += engine.update(plan, output)  # an empty plan commits its lifecycle too
        for out in results:
            if out.finished:
                self.owner.pop(out.request_id, None)
        return results

    def check_integrity(self) -> None:
        for engine in self.engines:
            engine.check_integrity()

    def metrics_text(self) -> str:
        """The engines' Prometheus text summed series by series (counters, histograms and the
        running / waiting gauges add up over the replicas; the KV-cache usage is their mean),
        in rank 0's order with its HELP / TYPE lines."""
        texts = [engine.metrics_text().splitlines() for engine in self.engines]
        totals: dict[str, float] = {}
        for lines in texts:
            for line in lines:
                if line and not line.startswith("#"):
                    series, _, text = line.rpartition(" ")
                    totals[series] = totals.get(series, 0.0) + float(text)
        out = []
        for line in texts[0]:
            if not line or line.startswith("#"):
                out.append(line)
                continue
            series = line.rpartition(" ")[0]
            total = totals[series]
            if series.startswith("resin:kv_cache_usage_perc"):
                total /= len(self.engines)
            out.append(f"{series} {int(total) if total == int(total) else total}")
        return "\n".join(out) + "\n"
