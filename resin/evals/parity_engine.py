"""Greedy-token parity through the full engine under stress settings (stage 3 of the harness).

The reference is an HF greedy loop in the runner's dtype, argmax per step: by default one
prefill, then incremental decoding on HF's own ``DynamicCache``; with ``greedy_reference =
"full_forward"`` (``parity.toml`` ``[reference]``) every step is a full no-cache forward over the
prompt and the tokens so far — the model's definition, for models whose HF cached decode departs
from it (DeepSeek-V4's CSA layers). :func:`cached_vs_full_forward` compares the two and says
where HF disagrees with itself (a finding for HF, reported, never imitated). EOS is ignored on both sides, so every
request produces exactly ``max_new_tokens`` tokens. Each stage builds a fresh
:class:`resin.Engine` around the same runner (``bind_cache`` is called again), submits every
prompt in one batch, steps to completion and compares tokens.
A mismatch where the HF top-1/top-2 logit gap is below ``tie_margin`` (or below what the
model dtype resolves at that logit's magnitude, :class:`GreedyReference`) is a near-tie: it
is counted, not failed, and that request is compared no further (it has legitimately
diverged).

Also here: :func:`runner_capture_prefill`, the one-request engine step that stages 1 and 2
read the runner's activations from, and the reference-failure helpers: when HF's own greedy
loop raises (a dtype HF cannot run on CPU, a broken modeling file), every greedy stage is
reported failed with ``reference crashed: <exception>`` (:func:`greedy_stages_or_reference_failure`)
rather than the exception escaping.

Stages: ``greedy/page_size=1``, ``=16``, ``=64``; ``greedy/chunked_prefill`` (token budget 13,
so prompts split across steps and page boundaries); ``greedy/prefix_cache`` (the batch twice;
the second pass must hit the prefix cache); ``greedy/preemption`` (4-token pages and a pool
that holds one max-length request, so the scheduler must preempt and recompute; a budget of
64 tokens, else of four pages or one where 64 forced no preemption, as in a layout of
sliding windows; the stage fails if no budget preempted, since the setting was then not
exercised).
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CHUNK_BUDGET_TOKENS = 13
# Small pages: every decoding request soon needs a fresh page, so a minimal pool must preempt.
PREEMPTION_PAGE_SIZE = 4
# The preemption stage's token budgets, tried in order until one forces a preemption.
PREEMPTION_BUDGETS_TOKENS = (64, 4 * PREEMPTION_PAGE_SIZE, PREEMPTION_PAGE_SIZE)
MAX_STEPS = 20000


@dataclass
class GreedyReference:
    """HF greedy continuations and the top-1/top-2 logit gap at each generated position, with
    the gap the model dtype cannot resolve there (``tie_floors``: four spacings at the top-1
    logit's magnitude, ``4 * eps * |top-1|``, as ``resin.evals.parity.Tolerances.tie_limit``;
    a bf16 logit of 40 is one spacing, 0.25, from its neighbours): a mismatch at a gap below
    the larger of it and ``tie_margin`` is a near-tie."""

    prompts: list[list[int]]
    tokens: list[list[int]]
    gaps: list[list[float]]
    max_new_tokens: int
    mode: str = "cached"
    tie_floors: list[list[float]] = field(default_factory=list)

    def near_tie(self, request: int, position: int, tie_margin: float) -> bool:
        """Whether the gap at ``position`` of request ``request`` is a near-tie."""
        floor = self.tie_floors[request][position] if self.tie_floors else 0.0
        return self.gaps[request][position] < max(tie_margin, floor)

    @classmethod
    def compute(
        cls, model: Any, prompts: Sequence[list[int]], max_new_tokens: int, mode: str = "cached"
    ) -> GreedyReference:
        """Greedy decode each prompt alone. ``cached``: one prefill, then incremental steps on
        HF's cache. ``full_forward``: each step one forward over the whole sequence so far,
        no cache (quadratic; for tiny checkpoints)."""
        import inspect

        import torch
        import transformers

        if mode not in GREEDY_REFERENCE_MODES:
            raise ValueError(f"greedy reference {mode!r}: expected one of {GREEDY_REFERENCE_MODES}")
        params = inspect.signature(model.forward).parameters
        cache_kwarg = "cache" if "cache" in params else "past_key_values"
        tokens: list[list[int]] = []
        gaps: list[list[float]] = []
        floors: list[list[float]] = []
        # The model's own precision: its logits may be upcast after an lm_head run in it.
        eps = torch.finfo(getattr(model, "dtype", torch.float32)).eps
        with torch.no_grad():
            for prompt in prompts:
                cache = transformers.DynamicCache(config=model.config)
                step_ids = list(prompt)
                out: list[int] = []
                gap: list[float] = []
                floor: list[float] = []
                for _ in range(max_new_tokens):
                    if mode == "cached":
                        result = model(
                            torch.tensor([step_ids]), use_cache=True, **{cache_kwarg: cache}
                        )
                    else:
                        result = model(torch.tensor([list(prompt) + out]), use_cache=False)
                    logits = result.logits[0, -1]
                    top = logits.float().topk(2)
                    out.append(int(top.indices[0]))
                    gap.append(float(top.values[0] - top.values[1]))
                    floor.append(UNRESOLVED_SPACINGS * eps * abs(float(top.values[0])))
                    step_ids = [out[-1]]
                tokens.append(out)
                gaps.append(gap)
                floors.append(floor)
        return cls([list(p) for p in prompts], tokens, gaps, max_new_tokens, mode, floors)


GREEDY_REFERENCE_MODES = ("cached", "full_forward")

UNRESOLVED_SPACINGS = 4
"""How many spacings of a low-precision dtype, at a logit's magnitude, a log-prob or a
top-1/top-2 gap is not resolved within: each is a difference of two logits, each held to two
spacings (torch.testing's bf16 rtol, 1.6e-2, is two)."""


def cached_vs_full_forward(
    model: Any, full: GreedyReference, tie_margin: float
) -> tuple[str | None, dict[str, Any]]:
    """Where HF's cached greedy decode departs from its full forward, teacher-forced on the
    full forward's tokens: (a sentence naming the first departure, or None; metrics: the
    number of argmax disagreements, the largest last-token logit difference and, at the first
    disagreement, both tokens and the full forward's top-1/top-2 gap — below ``tie_margin`` it
    is a near-tie, not a finding)."""
    import inspect

    import torch
    import transformers

    params = inspect.signature(model.forward).parameters
    cache_kwarg = "cache" if "cache" in params else "past_key_values"
    first: dict[str, Any] | None = None
    disagreements, max_diff = 0, 0.0
    with torch.no_grad():
        for i, (prompt, tokens) in enumerate(zip(full.prompts, full.tokens, strict=True)):
            cache = transformers.DynamicCache(config=model.config)
            step_ids = list(prompt)
            for j, token in enumerate(tokens):
                cached = model(torch.tensor([step_ids]), use_cache=True, **{cache_kwarg: cache})
                whole = model(torch.tensor([list(prompt) + tokens[:j]]), use_cache=False)
                a, b = cached.logits[0, -1].float(), whole.logits[0, -1].float()
                max_diff = max(max_diff, float((a - b).abs().max()))
                if int(a.argmax()) != token:
                    disagreements += 1
                    if first is None and not full.near_tie(i, j, tie_margin):
                        first = {
                            "request": i,
                            "position": j,
                            "cached_token": int(a.argmax()),
                            "full_forward_token": token,
                            "full_forward_gap": full.gaps[i][j],
                        }
                step_ids = [token]
    metrics: dict[str, Any] = {
        "argmax_disagreements": disagreements,
        "max_abs_logit_diff": max_diff,
    }
    if first is None:
        return None, metrics
    metrics["first"] = first
    return (
        f"HF's cached decode departs from its full forward at request {first['request']} "
        f"output position {first['position']}: cached argmax {first['cached_token']}, full "
        f"forward {first['full_forward_token']} (top-1/top-2 gap {first['full_forward_gap']:.3g}; "
        f"{disagreements} disagreement(s), max |logit diff| {max_diff:.3g})"
    ), metrics


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^resin:{name}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _pages_per_request(runner: Any, page_size: int, max_model_len: int, max_batched: int) -> int:
    """Pages one request of ``max_model_len`` tokens holds at once in ``runner``'s cache
    groups: the engine's own rule (:meth:`resin.CacheLayout.pages_per_request`)."""
    import resin

    specs = runner.cache_spec() if hasattr(runner, "cache_spec") else []
    layout = resin.CacheLayout.from_specs(list(specs), page_size)
    return int(layout.pages_per_request(max_model_len, max_batched, True))


def _make_engine(
    runner: Any,
    vocab_size: int,
    page_size: int,
    num_pages: int,
    max_batched: int,
    max_model_len: int,
) -> Any:
    import resin

    config = resin.EngineConfig(
        page_size=page_size,
        num_pages=num_pages,
        max_num_seqs=64,
        max_num_batched_tokens=max_batched,
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        eos_token_ids=[],
        vocab_size=vocab_size,
    )
    return _new_engine(config, runner)


def _new_engine(config: Any, runner: Any) -> Any:
    """An engine for ``runner``: DP attention's runner group gets one engine per rank."""
    import resin

    if getattr(runner, "data_parallel", False):
        from resin.runners.parallel.data_parallel import DataParallelEngine

        return DataParallelEngine(config, runner)
    return resin.Engine(config, runner)


def _smallest_engine(
    runner: Any, vocab_size: int, page_size: int, max_batched: int, max_model_len: int
) -> Any:
    """The engine with the fewest pages the engine accepts: one max-length request."""
    num_pages = 1 + _pages_per_request(runner, page_size, max_model_len, max_batched)
    return _make_engine(runner, vocab_size, page_size, num_pages, max_batched, max_model_len)


def _drive(engine: Any, ref: GreedyReference, prefix: str) -> dict[str, Any]:
    import resin

    params = resin.SamplingParams(max_tokens=ref.max_new_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(ref.prompts):
        engine.add_request(f"{prefix}{i}", prompt, params)
    finished: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps > MAX_STEPS:
            raise RuntimeError(f"engine did not finish in {MAX_STEPS} steps")
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def _compare(
    ref: GreedyReference, outputs: dict[str, Any], prefix: str, tie_margin: float
) -> tuple[dict[str, Any] | None, int, int]:
    """(first real mismatch or None, near-ties, tokens that matched before either)."""
    ties = compared = 0
    for i, expected in enumerate(ref.tokens):
        rid = f"{prefix}{i}"
        out = outputs.get(rid)
        got = list(out.token_ids) if out is not None else []
        for pos, want in enumerate(expected):
            have = got[pos] if pos < len(got) else None
            if have == want:
                compared += 1
                continue
            if have is not None and ref.near_tie(i, pos, tie_margin):
                ties += 1
                break
            return (
                {
                    "request": rid,
                    "prompt_index": i,
                    "prompt_len": len(ref.prompts[i]),
                    "position": pos,
                    "expected": want,
                    "got": have,
                    "hf_top2_gap": ref.gaps[i][pos],
                },
                ties,
                compared,
            )
    return None, ties, compared


def _stage(
    name: str,
    runner: Any,
    ref: GreedyReference,
    vocab_size: int,
    tie_margin: float,
    page_size: int,
    max_batched: int,
    small_pool: bool = False,
    passes: int = 1,
) -> Any:
    from resin.evals.parity import StageResult

    max_model_len = max(len(p) for p in ref.prompts) + ref.max_new_tokens + 1
    try:
        if small_pool:
            engine = _smallest_engine(runner, vocab_size, page_size, max_batched, max_model_len)
        else:
            # Room for every prompt at once (no preemption in this stage).
            per_request = _pages_per_request(runner, page_size, max_model_len, max_batched)
            num_pages = 1 + per_request * (len(ref.prompts) + 1)
            engine = _make_engine(
                runner, vocab_size, page_size, num_pages, max_batched, max_model_len
            )
        metrics: dict[str, Any] = {
            "page_size": page_size,
            "max_num_batched_tokens": max_batched,
            "num_pages": engine.config.num_pages,
        }
        first = None
        ties = compared = 0
        for p in range(passes):
            outputs = _drive(engine, ref, f"p{p}-")
            first, t, c = _compare(ref, outputs, f"p{p}-", tie_margin)
            ties, compared = ties + t, compared + c
            if p == passes - 1:
                metrics["num_cached_tokens"] = sum(o.num_cached_tokens for o in outputs.values())
            if first is not None:
                first["pass"] = p
                break
        text = engine.metrics_text()
        metrics.update(
            num_preemptions=_metric(text, "num_preemptions_total"),
            prefix_cache_hit_tokens=_metric(text, "prefix_cache_hits_total"),
            near_ties=ties,
            tokens_matched=compared,
        )
        engine.check_integrity()
    except Exception as exc:  # noqa: BLE001 - a crash is a finding
        return StageResult(name, False, f"crashed: {crash_detail(exc)}")
    if first is not None:
        return StageResult(
            name,
            False,
            f"request {first['request']} departs at output position {first['position']}",
            first,
            metrics,
        )
    if (
        passes > 1
        and metrics["num_cached_tokens"] == 0
        and any(len(p) > page_size for p in ref.prompts)
    ):
        return StageResult(name, False, "second pass did not hit the prefix cache", None, metrics)
    if small_pool and metrics["num_preemptions"] == 0 and len(ref.prompts) > 1:
        return StageResult(
            name, False, "pool did not force a preemption (setting not exercised)", None, metrics
        )
    detail = f"{compared} tokens match"
    if ties:
        detail += f" ({ties} near-tie divergences skipped)"
    return StageResult(name, True, detail, None, metrics)


PAGE_SIZES = (1, 16, 64)
GREEDY_STAGES = tuple(f"greedy/page_size={ps}" for ps in PAGE_SIZES) + (
    "greedy/chunked_prefill",
    "greedy/prefix_cache",
    "greedy/preemption",
)


def crash_detail(exc: BaseException) -> str:
    """A crash as the model's author needs it: the original exception (a ``StepError``'s
    cause: the runner's ``KeyError`` rather than the engine's wrapper) with its type, and where
    it was raised, the innermost frame in a model directory's code (``blocks.py``) when there is
    one, else the innermost of all."""
    cause = getattr(exc, "cause", None) or exc
    frames = traceback.extract_tb(cause.__traceback__)
    ours = [f for f in frames if "/models/" in f.filename.replace("\\", "/")]
    where = (ours or frames)[-1:] if frames else []
    at = f" at {where[0].filename}:{where[0].lineno} in {where[0].name}" if where else ""
    wrapped = f" (in {type(exc).__name__})" if cause is not exc else ""
    return f"{type(cause).__name__}: {cause}{at}{wrapped}"


REFERENCE_CRASHED = "reference crashed"


def run_greedy_stages(
    runner: Any, ref: GreedyReference, vocab_size: int, tie_margin: float
) -> list[Any]:
    """All stress stages, in order (:data:`GREEDY_STAGES`); each is independent (a fresh engine)."""
    big = max(len(p) for p in ref.prompts) * len(ref.prompts) + 64
    stages = [
        _stage(f"greedy/page_size={ps}", runner, ref, vocab_size, tie_margin, ps, big)
        for ps in PAGE_SIZES
    ]
    stages.append(
        _stage(
            "greedy/chunked_prefill", runner, ref, vocab_size, tie_margin, 16, CHUNK_BUDGET_TOKENS
        )
    )
    stages.append(
        _stage("greedy/prefix_cache", runner, ref, vocab_size, tie_margin, 16, big, passes=2)
    )
    stages.append(_preemption_stage(runner, ref, vocab_size, tie_margin))
    return stages


def _preemption_stage(runner: Any, ref: GreedyReference, vocab_size: int, tie_margin: float) -> Any:
    """``greedy/preemption`` with a token budget of 64, then, while none forced a preemption,
    of four pages and of one. The pool holds one max-length request, and that bound counts
    a whole chunk's pages on top of its windows: where layers keep sliding windows (or
    compressed caches), two requests past their prefill may fit in a pool sized for a
    64-token chunk. A smaller chunk shrinks the pool, but also staggers the requests (a short
    one may finish before a long one's prefill does), hence the middle budget."""
    stage = None
    for budget in PREEMPTION_BUDGETS_TOKENS:
        stage = _stage(
            "greedy/preemption",
            runner,
            ref,
            vocab_size,
            tie_margin,
            PREEMPTION_PAGE_SIZE,
            budget,
            small_pool=True,
        )
        if stage.passed or stage.metrics.get("num_preemptions", 1) != 0:
            return stage
        if stage.first_mismatch is not None:
            return stage  # tokens departed: that is the finding, whatever the budget
    return stage


def exception_text(exc: BaseException, limit: int = 600) -> str:
    """``Type: message`` on one line, at most ``limit`` characters (for stage details)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reference_failed_stages(names: Sequence[str], detail: str) -> list[Any]:
    """The stages ``names``, each failed with ``detail``: the HF reference could not produce
    what they compare against, so the runner was not checked by them."""
    from resin.evals.parity import StageResult

    return [StageResult(name, False, detail, None, {"reference_error": detail}) for name in names]


def greedy_stages_or_reference_failure(
    runner: Any, compute: Any, vocab_size: int, tie_margin: float
) -> tuple[GreedyReference | None, list[Any]]:
    """(reference, stages): ``compute()`` builds the HF greedy reference; if it raises, every
    greedy stage fails with ``reference crashed: ...`` instead of the exception escaping."""
    try:
        reference = compute()
    except Exception as exc:  # noqa: BLE001 - the reference crashing is a finding too
        detail = f"{REFERENCE_CRASHED}: HF greedy decoding raised {exception_text(exc)}"
        return None, reference_failed_stages(GREEDY_STAGES, detail)
    return reference, run_greedy_stages(runner, reference, vocab_size, tie_margin)


def runner_capture_prefill(
    runner: Any, prompt: list[int], vocab_size: int, top_k: int = 5
) -> tuple[dict[str, Any] | None, dict[int, float] | None, int | None]:
    """One-request engine prefill with the runner's capture hook on.

    The capture protocol (the torch reference runner's): ``runner.capture`` is None or a dict;
    set to a dict, each forward stores ``{module_name: tensor [T, ...]}`` under transformers'
    module names (``model.layers.{i}.self_attn``, ``model.norm``, ``lm_head`` = logits of every
    token). Returns (activations or None if the runner has no ``capture`` attribute, the
    engine's top-k log-probs for the first sampled token, the sampled token)."""
    import resin

    page_size = 16
    max_batched = max(len(prompt), 16)
    pages = 1 + _pages_per_request(runner, page_size, len(prompt) + 2, max_batched)
    config = resin.EngineConfig(
        page_size=page_size,
        num_pages=pages,
        max_num_seqs=4,
        max_num_batched_tokens=max_batched,
        max_model_len=len(prompt) + 2,
        enable_prefix_caching=False,
        eos_token_ids=[],
        vocab_size=vocab_size,
    )
    engine = _new_engine(config, runner)
    engine.add_request(
        "parity-prefill",
        prompt,
        resin.SamplingParams(max_tokens=1, temperature=0.0, logprobs=top_k, ignore_eos=True),
    )
    if not hasattr(runner, "capture"):
        return None, *_first_token(engine.step())
    captured: dict[str, Any] = {}
    previous, runner.capture = runner.capture, captured
    try:
        outs = engine.step()
    finally:
        runner.capture = previous
    return {_normalise(k): v for k, v in captured.items()}, *_first_token(outs)


def _first_token(outs: list[Any]) -> tuple[dict[int, float] | None, int | None]:
    out = next(o for o in outs if o.request_id == "parity-prefill")
    logprobs = out.logprobs[0] if out.logprobs else None
    return logprobs, (out.token_ids[0] if out.token_ids else None)


def _normalise(name: str) -> str:
    """Runner capture names (transformers module names) -> checkpoint names."""
    if name == "lm_head":
        return "logits"
    return name[len("model.") :] if name.startswith("model.") else name
