"""The one-call layer paths (``layers.rms_norm`` as ``resin._core.rms_norm``,
``layers.apply_rotary`` as ``resin._core.rotary_embedding``) against the torch lines they
replace, on CPU in float32 or (``--dtype bfloat16``) bfloat16.

Two measurements, both in one process with ``layers.one_call_paths`` switched between runs:

- per call: microseconds of one norm ([T, 512]) and one q rotation ([T, 8, 64]) at T = 1 and 64,
  best of ``--repeats`` rounds of 2,000 calls (isolated: no matmul between calls);
- end to end: ``LLM.generate`` tokens/s on the 23M Llama of ``offline_throughput.py`` (64-token
  random prompts, 64 greedy tokens, 2 threads), one engine per concurrency, the two settings
  interleaved ``--repeats`` times on fresh prompts; best and median run.

The floats are the same either way (tests/test_torch_layers.py), so only time differs::

    .venv/bin/python benchmarks/layer_ops.py --concurrency 1,8,64 --repeats 6
    .venv/bin/python benchmarks/layer_ops.py --dtype bfloat16 --concurrency 1,8,64 --repeats 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import CHECKPOINT, REPO, make_checkpoint, random_prompts  # noqa: E402

SETTINGS = {"one call": True, "torch lines": False}


def per_call_us(repeats: int, dtype: str) -> list[dict[str, float | int | str]]:
    import torch

    from resin.runners.torch import layers

    rows = []
    for tokens in (1, 64):

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape).to(getattr(torch, dtype))

        x, weight = randn(tokens, 512), randn(512)
        q, cos, sin = randn(tokens, 8, 64), randn(tokens, 64), randn(tokens, 64)
        ops: dict[str, Callable[[], object]] = {
            "rms_norm": lambda x=x, w=weight: layers.rms_norm(x, w, 1e-6),
            "apply_rotary": lambda q=q, c=cos, s=sin: layers.apply_rotary(q, c, s),
        }
        for op, call in ops.items():
            row: dict[str, float | int | str] = {"op": op, "tokens": tokens}
            for label, on in SETTINGS.items():
                layers.one_call_paths = on
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    for _ in range(2000):
                        call()
                    best = min(best, (time.perf_counter() - start) / 2000 * 1e6)
                row[label] = best
            rows.append(row)
    layers.one_call_paths = True
    return rows


def end_to_end(
    concurrency: int, repeats: int, vocab_size: int, dtype: str
) -> dict[str, list[float]]:
    import resin
    from resin.llm import LLM
    from resin.runners.torch import layers

    llm = LLM(
        CHECKPOINT,
        max_num_seqs=concurrency,
        max_model_len=1024,
        attention_backend="torch",
        dtype=dtype,
    )
    params = resin.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate(random_prompts(1, 64, vocab_size, seed=999_999), params)  # first-call costs
    runs: dict[str, list[float]] = {label: [] for label in SETTINGS}
    for repeat in range(repeats):
        for i, (label, on) in enumerate(SETTINGS.items()):
            layers.one_call_paths = on
            prompts = random_prompts(concurrency, 64, vocab_size, seed=repeat * 10 + i)
            start = time.perf_counter()
            llm.generate(prompts, params)
            runs[label].append(concurrency * 64 / (time.perf_counter() - start))
    layers.one_call_paths = True
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "layer_ops.json"))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    make_checkpoint()
    vocab_size = json.loads((CHECKPOINT / "config.json").read_text())["vocab_size"]

    print(f"torch {torch.__version__}, {args.dtype}, 2 threads")
    calls = per_call_us(args.repeats, args.dtype)
    print("| op | tokens | one call us | torch lines us | ratio |\n|---|---|---|---|---|")
    for r in calls:
        one, lines = float(r["one call"]), float(r["torch lines"])
        print(f"| {r['op']} | {r['tokens']} | {one:.1f} | {lines:.1f} | {one / lines:.2f}x |")

    e2e = []
    print("\n| requests | one call tok/s best / median | torch lines best / median | ratio |")
    print("|---|---|---|---|")
    for c in (int(v) for v in args.concurrency.split(",")):
        runs = end_to_end(c, args.repeats, vocab_size, args.dtype)
        e2e.append({"concurrency": c, "runs": runs})
        one, lines = runs["one call"], runs["torch lines"]
        print(
            f"| {c} | {max(one):.0f} / {statistics.median(one):.0f} | "
            f"{max(lines):.0f} / {statistics.median(lines):.0f} | "
            f"{max(one) / max(lines):.2f}x / "
            f"{statistics.median(one) / statistics.median(lines):.2f}x |"
        )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps(
            {
                "dtype": args.dtype,
                "per_call_us": calls,
                "end_to_end_tok_s": e2e,
                "repeats": args.repeats,
            },
            indent=2,
        )
    )
    print(f"\nJSON: {args.output}")


if __name__ == "__main__":
    main()
