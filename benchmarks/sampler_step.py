"""One sampler step at 256 rows: mixed sampling settings vs greedy, the sampler before and after
the batched draw (issue 14), and the step's cost at 64 and 1,024 generated tokens.

A real ``resin.Engine`` schedules 256 requests; its runner feeds each plan's lifecycle diff to
both samplers (``begin_step``) and answers with fixed tokens, so after N generated tokens both
samplers hold the same histories (penalties need them). On the captured decode plan the
benchmark times ``Sampler.sample(logits, plan, rows)`` — penalties, bans, filters, the draw and
the output — median of ``--repeats`` calls, each sampler on the same logits:

- "before": ``resin/sampling.py`` at ``--before`` (default 2b7ac0d, the last per-row sampler:
  a Python loop over rows, a ``torch.Generator`` per seeded row, two full sorts for
  top-k / top-p), loaded from git into a temporary module; "after": the working tree's.
- greedy: 256 rows at temperature 0, nothing else; mixed: eight settings, 32 rows each
  (greedy with penalties; temperature alone; top-k; top-p; top-k + top-p; min-p; top-p with a
  repetition penalty; top-k with frequency and presence penalties; most seeded).
- "mixed, torch searches": the working tree's mixed step with
  ``resin.sampling_candidates.candidates_kernel`` and ``resin.sampling_filters.nucleus_kernel``
  off (candidates from the torch tree of block maxima, a nucleus past them from ``topk``
  searches, not ``_core.top_candidates`` / ``_core.nucleus_cut``, nor ``_core.sample_rows``);
  same tokens, checked.
- "rows kernel off": the working tree's mixed step with ``resin.sampling_kernel.rows_kernel``
  off (the drawn rows through the torch path and its Rust searches, not one
  ``_core.sample_rows`` call); same tokens, checked.
- "torch only": the working tree's greedy and mixed steps with every Rust kernel off (those
  three, ``resin.sampling_greedy.argmax_kernel`` and ``resin.sampling_draw.draw_kernel``: the
  greedy pick torch's ``argmax``, the whole-row draw torch's ``cumsum`` + ``searchsorted``),
  the path a device without the kernels takes; same tokens, checked.
- logits: "peaked" (LLM-like: a N(0, 2) bulk with 8 tokens 10-16 above it, the top one
  taking ~0.9 of the mass) or "flat" (the bulk alone: a top-p nucleus of thousands of tokens,
  the worst case for a candidate set).

Greedy rows must agree between the two samplers (same penalties, same argmax); the benchmark
checks it. Every row of the mixed step must also give the very token the batched sampler gave
before its fast path (``--same-as``, default 408029d: ``topk(256)`` over the whole row, fresh
tensors, a sort for a wide nucleus; unseeded rows from the same generator state); checked for
each vocabulary and kind of logits. The rows kernel's parts: ``_core.sample_rows`` alone on 32
rows held in cache, per drawn setting, against ``_core.argmax`` on them. The logprobs rows: the mixed step with ``logprobs=5`` on
every row at 64 and 1,024 generated tokens, and the same step without logprobs.

    .venv/bin/python benchmarks/sampler_step.py   # prints tables, writes results/sampler_step.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import resin
import resin.sampling_candidates
import resin.sampling_draw
import resin.sampling_filters
import resin.sampling_greedy
import resin.sampling_kernel
from resin import Engine, EngineConfig, ForwardOutput, SamplingParams
from resin.sampling import Sampler

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NUM_ROWS = 256
PROMPT_LEN = 32
MIXED = [
    dict(temperature=0.0, repetition_penalty=1.05, presence_penalty=0.2),
    dict(temperature=0.7),
    dict(temperature=0.8, top_k=50, seed=1),
    dict(temperature=1.0, top_p=0.9, seed=2),
    dict(temperature=0.6, top_k=40, top_p=0.95, seed=3),
    dict(temperature=1.0, min_p=0.05, seed=4),
    dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1, seed=5),
    dict(temperature=0.9, top_k=100, frequency_penalty=0.3, presence_penalty=0.5),
]


def load_before(rev: str) -> type:
    """The ``Sampler`` class of ``resin/sampling.py`` at git revision ``rev`` (one module then,
    importing only modules that still exist)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:resin/sampling.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    name = f"sampling_{rev}"
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Sampler  # type: ignore[no-any-return]


class HistoryRunner:
    """Feeds every plan to the samplers' ``begin_step`` and answers fixed pseudo-random tokens;
    keeps the last plan where all rows decode."""

    def __init__(self, samplers: list[Any], vocab_size: int) -> None:
        self.samplers, self.vocab_size = samplers, vocab_size
        self.rng = np.random.default_rng(0)
        self.decode_plan: resin.BatchPlan | None = None

    def forward(self, plan: resin.BatchPlan) -> ForwardOutput:
        for sampler in self.samplers:
            sampler.begin_step(plan)
        n = plan.num_sequences
        if n == NUM_ROWS and int(np.diff(plan.sample_indptr).sum()) == n:
            self.decode_plan = plan
        tokens = self.rng.integers(0, min(self.vocab_size, 30000), n).astype(np.uint32)
        indptr = np.arange(n + 1, dtype=np.uint32)
        k = max(int(plan.sampling.num_logprobs.max()), 0) if n else 0
        if k == 0:
            return ForwardOutput(tokens, indptr)
        top_ids = np.zeros((n, k), np.uint32)
        return ForwardOutput(
            tokens, indptr, np.zeros(n, np.float32), top_ids, np.zeros((n, k), np.float32)
        )


def capture(
    settings: list[dict[str, Any]], num_generated: int, vocab_size: int, samplers: list[Any]
) -> resin.BatchPlan:
    """The decode plan after ``num_generated`` tokens of 256 requests cycling ``settings``."""
    config = EngineConfig(
        page_size=16,
        num_pages=NUM_ROWS * ((PROMPT_LEN + num_generated) // 16 + 2) + 16,
        max_model_len=PROMPT_LEN + num_generated + 16,
        max_num_seqs=NUM_ROWS,
        max_num_batched_tokens=8192,
        vocab_size=vocab_size,
        eos_token_ids=[],
    )
    runner = HistoryRunner(samplers, vocab_size)
    engine = Engine(config, runner)
    rng = np.random.default_rng(1)
    for i in range(NUM_ROWS):
        prompt = rng.integers(0, min(vocab_size, 30000), PROMPT_LEN).tolist()
        params = SamplingParams(
            max_tokens=num_generated + 1, ignore_eos=True, **settings[i % len(settings)]
        )
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(num_generated):
        engine.step()
    assert runner.decode_plan is not None and runner.decode_plan.num_sequences == NUM_ROWS
    return runner.decode_plan


def make_logits(kind: str, vocab_size: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(NUM_ROWS, vocab_size, generator=gen) * 2.0
    if kind == "peaked":
        top = torch.randint(0, vocab_size, (NUM_ROWS, 8), generator=gen)
        lift = torch.tensor([16.0, 13.0, 12.0, 11.5, 11.0, 10.5, 10.0, 10.0])
        logits.scatter_(1, top, lift.expand(NUM_ROWS, 8) + torch.randn(NUM_ROWS, 8, generator=gen))
    return logits


def median_ms(calls: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median wall time (ms) of each call, the calls interleaved round by round (after one
    warm-up round), so a noisy machine slows them alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(repeats + 1):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) * 1e3 for name, t in times.items()}


def step(sampler: Any, logits: torch.Tensor, plan: resin.BatchPlan) -> Any:
    rows = np.arange(plan.num_sequences)
    return lambda: sampler.sample(logits, plan, rows)


ROWS_KERNEL = [(resin.sampling_kernel, "rows_kernel")]
"""The switch of the draw in one Rust call (``_core.sample_rows``); off, the drawn rows take the
torch path with its Rust searches (the sampler before that kernel)."""

BOUNDED_DRAW = [(resin.sampling_kernel, "bounded_draw")]
"""The switch of the bounded decisions inside ``_core.sample_rows`` (the whole-row draw and the
top-p cut over the whole row, from cheap exponentials and an error bound)."""

SEARCH_KERNELS = [
    *ROWS_KERNEL,
    (resin.sampling_candidates, "candidates_kernel"),
    (resin.sampling_filters, "nucleus_kernel"),
]
"""The switches of the two search kernels (``_core.top_candidates``, ``_core.nucleus_cut``),
and of the draw in one call that would pass them by."""

ALL_KERNELS = [
    *SEARCH_KERNELS,
    (resin.sampling_greedy, "argmax_kernel"),
    (resin.sampling_draw, "draw_kernel"),
]
"""Every Rust kernel's switch in the sampler (and ``_core.argmax``, ``_core.inverse_cdf``)."""


def kernels_off(call: Any, switches: list[tuple[Any, str]]) -> Any:
    """``call`` with the kernels of ``switches`` off (their torch paths), on again after."""

    def run() -> Any:
        before = [getattr(module, name) for module, name in switches]
        for module, name in switches:
            setattr(module, name, False)
        try:
            return call()
        finally:
            for (module, name), value in zip(switches, before):
                setattr(module, name, value)

    return run


def torch_search_step(sampler: Any, logits: torch.Tensor, plan: resin.BatchPlan) -> Any:
    """:func:`step` with the candidates and a wide nucleus found by the torch searches, not
    ``_core.top_candidates`` / ``_core.nucleus_cut`` (the CPU path before those kernels)."""
    return kernels_off(step(sampler, logits, plan), SEARCH_KERNELS)


def greedy_tokens(sampler: Any, logits: torch.Tensor, plan: resin.BatchPlan) -> np.ndarray:
    out = sampler.sample(logits, plan, np.arange(plan.num_sequences))
    greedy = np.asarray(plan.sampling.temperature) == 0
    return np.asarray(out.token_ids)[greedy]


def same_tokens(samplers: list[Any], logits: torch.Tensor, plan: resin.BatchPlan) -> bool:
    """Whether the samplers give every row the same token (unseeded rows drawing from the same
    generator state)."""
    tokens = []
    for sampler in samplers:
        sampler.generator.manual_seed(0)
        tokens.append(
            np.asarray(sampler.sample(logits, plan, np.arange(plan.num_sequences)).token_ids)
        )
    return all(np.array_equal(tokens[0], t) for t in tokens[1:])


def step_rows(
    vocabs: list[int], repeats: int, before_repeats: int, before_cls: type, same_cls: type
) -> list[dict[str, Any]]:
    rows = []
    for vocab_size in vocabs:
        greedy_samplers = [before_cls(vocab_size), Sampler(vocab_size)]
        greedy_plan = capture([dict(temperature=0.0)], 16, vocab_size, greedy_samplers)
        mixed_samplers = [before_cls(vocab_size), Sampler(vocab_size), same_cls(vocab_size)]
        mixed_plan = capture(MIXED, 64, vocab_size, mixed_samplers)
        for kind in ("peaked", "flat"):
            logits = make_logits(kind, vocab_size)
            before, after, same_as = mixed_samplers
            same = np.array_equal(
                greedy_tokens(before, logits, mixed_plan), greedy_tokens(after, logits, mixed_plan)
            )
            assert same, "greedy rows differ between the samplers"
            identical = same_tokens([same_as, after], logits, mixed_plan)
            assert identical, "the mixed step's tokens differ from the --same-as sampler's"
            after.generator.manual_seed(0)
            kernel_off = np.asarray(torch_search_step(after, logits, mixed_plan)().token_ids)
            after.generator.manual_seed(0)
            torch_only = kernels_off(step(after, logits, mixed_plan), ALL_KERNELS)
            torch_tokens = np.asarray(torch_only().token_ids)
            after.generator.manual_seed(0)
            no_rows_kernel = kernels_off(step(after, logits, mixed_plan), ROWS_KERNEL)
            rows_kernel_off = np.asarray(no_rows_kernel().token_ids)
            after.generator.manual_seed(0)
            no_bounded = kernels_off(step(after, logits, mixed_plan), BOUNDED_DRAW)
            bounded_off = np.asarray(no_bounded().token_ids)
            after.generator.manual_seed(0)
            kernel_on = np.asarray(step(after, logits, mixed_plan)().token_ids)
            assert np.array_equal(kernel_on, rows_kernel_off), "the rows kernel changed a token"
            assert np.array_equal(kernel_on, bounded_off), "the bounded draw changed a token"
            assert np.array_equal(kernel_on, kernel_off), "a search kernel changed a token"
            assert np.array_equal(kernel_on, torch_tokens), "a kernel changed a token"
            greedy_torch = kernels_off(step(greedy_samplers[1], logits, greedy_plan), ALL_KERNELS)
            assert np.array_equal(
                np.asarray(greedy_torch().token_ids),
                np.asarray(step(greedy_samplers[1], logits, greedy_plan)().token_ids),
            ), "the argmax kernel changed a token"
            row: dict[str, Any] = {"vocab_size": vocab_size, "logits": kind}
            row["tokens_identical_to_same_as"] = identical
            for name, index, n in (("after", 1, repeats), ("before", 0, before_repeats)):
                calls = {
                    "greedy": step(greedy_samplers[index], logits, greedy_plan),
                    "mixed": step(mixed_samplers[index], logits, mixed_plan),
                }
                if name == "after":  # the --same-as sampler and the torch paths too
                    calls["mixed_same_as"] = step(same_as, logits, mixed_plan)
                    calls["mixed_torch_search"] = torch_search_step(after, logits, mixed_plan)
                    calls["mixed_no_rows_kernel"] = no_rows_kernel
                    calls["mixed_no_bounded_draw"] = no_bounded
                    calls["greedy_torch_only"] = greedy_torch
                    calls["mixed_torch_only"] = torch_only
                timed = median_ms(calls, n)
                row[f"greedy_{name}_ms"], row[f"mixed_{name}_ms"] = timed["greedy"], timed["mixed"]
                if name == "after":
                    for key in (
                        "mixed_same_as",
                        "mixed_torch_search",
                        "mixed_no_rows_kernel",
                        "mixed_no_bounded_draw",
                    ):
                        row[f"{key}_ms"] = timed[key]
                    for key in ("greedy_torch_only", "mixed_torch_only"):
                        row[f"{key}_ms"] = timed[key]
                print(f"  vocab {vocab_size} {kind} {name}: {timed}", flush=True)
            row["mixed_over_greedy_after"] = row["mixed_after_ms"] / row["greedy_after_ms"]
            row["mixed_over_greedy_torch_only"] = (
                row["mixed_torch_only_ms"] / row["greedy_torch_only_ms"]
            )
            row["mixed_speedup"] = row["mixed_before_ms"] / row["mixed_after_ms"]
            row["mixed_speedup_vs_same_as"] = row["mixed_same_as_ms"] / row["mixed_after_ms"]
            rows.append(row)
    return rows


def kernel_part_rows(vocabs: list[int], repeats: int) -> list[dict[str, Any]]:
    """Per drawn setting of MIXED: ``_core.sample_rows`` on 32 rows of peaked logits (8 MB at
    32k: they stay in the cache, so this is the kernel's arithmetic, not the memory's), in
    us a row, next to ``_core.argmax`` on the same rows (greedy's cost a row)."""
    from resin import _core
    from resin.sampling_kernel import kernel_tokens, softmax_lanes

    if softmax_lanes() is None:
        return []
    out = []
    for vocab_size in vocabs:
        logits = make_logits("peaked", vocab_size)[:32].contiguous()
        rows = np.arange(32, dtype=np.int64)
        tokens = np.empty(32, dtype=np.int64)
        x = logits.numpy()
        calls: dict[str, Any] = {"argmax": lambda x=x, t=tokens: _core.argmax(x, t)}
        for i, settings in enumerate(MIXED):
            if settings.get("temperature", 1.0) == 0:
                continue
            columns = [
                np.full(32, settings.get(key, default), dtype=dtype)
                for key, default, dtype in (
                    ("temperature", 1.0, np.float32),
                    ("top_k", 0, np.int64),
                    ("top_p", 1.0, np.float32),
                    ("min_p", 0.0, np.float32),
                )
            ]
            uniforms = np.linspace(0.01, 0.99, 32, dtype=np.float32)
            calls[str(i)] = lambda lg=logits, r=rows, c=columns, u=uniforms: kernel_tokens(
                lg, r, *c, u
            )
        timed = median_ms(calls, repeats)
        for key, ms in timed.items():
            label = "argmax (greedy)" if key == "argmax" else json.dumps(MIXED[int(key)])
            out.append({"vocab_size": vocab_size, "setting": label, "us_per_row": ms * 1e3 / 32})
    return out


def logprob_rows(
    vocab_size: int, repeats: int, before_repeats: int, before_cls: type
) -> list[dict[str, Any]]:
    rows = []
    settings = [dict(s, logprobs=5) for s in MIXED]
    logits = make_logits("peaked", vocab_size)
    for num_generated in (64, 1024):
        samplers = [before_cls(vocab_size), Sampler(vocab_size)]
        plan = capture(settings, num_generated, vocab_size, samplers)
        bare = [before_cls(vocab_size), Sampler(vocab_size)]
        bare_plan = capture(MIXED, num_generated, vocab_size, bare)
        row: dict[str, Any] = {"vocab_size": vocab_size, "generated_tokens": num_generated}
        for name, index, n in (("after", 1, repeats), ("before", 0, before_repeats)):
            timed = median_ms(
                {
                    "with": step(samplers[index], logits, plan),
                    "without": step(bare[index], logits, bare_plan),
                },
                n,
            )
            row[f"with_logprobs_{name}_ms"], row[f"without_{name}_ms"] = (
                timed["with"],
                timed["without"],
            )
        print(f"  logprobs at {num_generated} tokens: {row}", flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--logprobs-vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--before-repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--before", default="2b7ac0d", help="git revision of the 'before' sampler")
    parser.add_argument(
        "--same-as",
        default="408029d",
        help="git revision of a sampler whose tokens the working tree's must equal",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    before_cls = load_before(args.before)
    same_cls = load_before(args.same_as)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {NUM_ROWS} rows, median of {args.repeats}"
    )
    steps = step_rows(args.vocab, args.repeats, args.before_repeats, before_cls, same_cls)
    logprobs = logprob_rows(args.logprobs_vocab, args.repeats, args.before_repeats, before_cls)
    parts = kernel_part_rows(args.vocab, args.repeats)

    print(f"\nSampler step, ms (median); mixed tokens identical to {args.same_as}'s: checked\n")
    print(
        f"| vocab | logits | greedy before | greedy after | mixed before | mixed {args.same_as} "
        f"| mixed, torch searches | mixed after | mixed / greedy (after) "
        f"| mixed speed-up vs before / vs {args.same_as} |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in steps:
        print(
            f"| {r['vocab_size']:,} | {r['logits']} | {r['greedy_before_ms']:.1f} | {r['greedy_after_ms']:.1f} "
            f"| {r['mixed_before_ms']:.1f} | {r['mixed_same_as_ms']:.1f} "
            f"| {r['mixed_torch_search_ms']:.1f} | {r['mixed_after_ms']:.1f} "
            f"| {r['mixed_over_greedy_after']:.2f}x "
            f"| {r['mixed_speedup']:.1f}x / {r['mixed_speedup_vs_same_as']:.1f}x |"
        )
    print(
        "\nThe same steps with every sampler kernel on (after) and off (torch only), ms (median)\n"
    )
    print(
        "| vocab | logits | greedy, torch only | greedy after | mixed, torch only | mixed after "
        "| greedy speed-up | mixed speed-up | mixed / greedy, torch only | mixed / greedy, after |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in steps:
        print(
            f"| {r['vocab_size']:,} | {r['logits']} | {r['greedy_torch_only_ms']:.1f} "
            f"| {r['greedy_after_ms']:.1f} | {r['mixed_torch_only_ms']:.1f} | {r['mixed_after_ms']:.1f} "
            f"| {r['greedy_torch_only_ms'] / r['greedy_after_ms']:.2f}x "
            f"| {r['mixed_torch_only_ms'] / r['mixed_after_ms']:.2f}x "
            f"| {r['mixed_over_greedy_torch_only']:.2f}x | {r['mixed_over_greedy_after']:.2f}x |"
        )
    print("\nThe draw in one Rust call (_core.sample_rows) on and off, ms (median)\n")
    print(
        "| vocab | logits | greedy | mixed, rows kernel off | mixed | rows kernel speed-up "
        "| mixed / greedy, rows kernel off | mixed / greedy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in steps:
        off = r["mixed_no_rows_kernel_ms"]
        print(
            f"| {r['vocab_size']:,} | {r['logits']} | {r['greedy_after_ms']:.1f} | {off:.1f} "
            f"| {r['mixed_after_ms']:.1f} | {off / r['mixed_after_ms']:.2f}x "
            f"| {off / r['greedy_after_ms']:.2f}x | {r['mixed_over_greedy_after']:.2f}x |"
        )
    print("\nThe bounded decisions (whole-row draw, top-p cut) on and off, ms (median)\n")
    print("| vocab | logits | greedy | mixed, exact sums | mixed | speed-up | mixed / greedy |")
    print("|---|---|---|---|---|---|---|")
    for r in steps:
        off = r["mixed_no_bounded_draw_ms"]
        print(
            f"| {r['vocab_size']:,} | {r['logits']} | {r['greedy_after_ms']:.1f} | {off:.1f} "
            f"| {r['mixed_after_ms']:.1f} | {off / r['mixed_after_ms']:.2f}x "
            f"| {r['mixed_over_greedy_after']:.2f}x |"
        )
    print("\nThe rows kernel a row, by setting (32 rows in cache; penalties aside), us\n")
    print("| vocab | setting | us a row |")
    print("|---|---|---|")
    for r in parts:
        print(f"| {r['vocab_size']:,} | {r['setting']} | {r['us_per_row']:.1f} |")
    print(
        f"\nMixed step with and without logprobs=5 (vocab {args.logprobs_vocab:,}, peaked), ms (median)\n"
    )
    print(
        "| generated tokens | before, with | before, without | after, with | after, without | after: logprobs cost |"
    )
    print("|---|---|---|---|---|---|")
    for r in logprobs:
        print(
            f"| {r['generated_tokens']:,} | {r['with_logprobs_before_ms']:.1f} | {r['without_before_ms']:.1f} "
            f"| {r['with_logprobs_after_ms']:.1f} | {r['without_after_ms']:.1f} "
            f"| {r['with_logprobs_after_ms'] - r['without_after_ms']:.1f} |"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out_path = RESULTS / "sampler_step.json"
    payload = {
        "benchmark": "sampler_step",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "num_rows": NUM_ROWS,
        "repeats": args.repeats,
        "before_repeats": args.before_repeats,
        "before": args.before,
        "same_as": args.same_as,
        "mixed_settings": MIXED,
        "steps": steps,
        "logprobs": logprobs,
        "rows_kernel_parts": parts,
    }
    out_path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nJSON: {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
