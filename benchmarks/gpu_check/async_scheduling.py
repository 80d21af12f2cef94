"""Overlapped scheduling on a GPU: tokens/s of ``resin.LLM.generate`` with ``async_scheduling``
off and on, same checkpoint, same requests, the two interleaved (benchmarks/gpu_check.sh,
step ``async``).

    python async_scheduling.py CHECKPOINT [--device cuda] [--attention-backend triton]
        [--requests 64] [--prompt-len 64] [--output-len 128] [--repeats 3] [--out FILE]

Each contender is one ``LLM`` (CUDA graphs as the runner captures them), warmed once; every
repeat gives both the same fresh random prompts (greedy, EOS ignored) and checks they generate
the same tokens. Prints a markdown table (best and median tokens/s, on / off) and writes JSON.
A small model shows the overlap best: its steps are short, so the host's work between them
(committing a step, the caller's handling of its outputs) is a larger share of the time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attention-backend", default="triton")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import numpy as np

    import resin

    contenders: dict[str, Any] = {}
    for name, overlapped in (("sync", False), ("async", True)):
        contenders[name] = resin.LLM(
            args.checkpoint,
            device=args.device,
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            max_num_seqs=args.requests,
            max_model_len=args.prompt_len + args.output_len + 16,
            async_scheduling=overlapped,
        )
        assert contenders[name].engine.async_scheduling is overlapped
    vocab = contenders["sync"].tokenizer.vocab_size
    params = resin.SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)

    def prompts() -> list[list[int]]:
        return rng.integers(16, vocab, (args.requests, args.prompt_len)).tolist()

    warm = prompts()
    for llm in contenders.values():
        llm.generate(warm, params)
    tok_s: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeats):
        batch = prompts()
        tokens = {}
        for name, llm in contenders.items():
            start = time.perf_counter()
            outputs = llm.generate(batch, params)
            seconds = time.perf_counter() - start
            tok_s[name].append(args.requests * args.output_len / seconds)
            tokens[name] = [o.token_ids for o in outputs]
        if tokens["sync"] != tokens["async"]:
            raise SystemExit("async_scheduling changed the generated tokens")
    best = {name: max(v) for name, v in tok_s.items()}
    median = {name: statistics.median(v) for name, v in tok_s.items()}
    print(
        f"{args.requests} requests x {args.prompt_len} + {args.output_len} tokens, "
        f"{args.device} {args.dtype}, {args.attention_backend} backend, {args.repeats} repeats"
    )
    print("| | sync tok/s | async tok/s | async / sync |")
    print("|---|---|---|---|")
    for label, values in (("best", best), ("median", median)):
        ratio = values["async"] / values["sync"]
        print(f"| {label} | {values['sync']:.0f} | {values['async']:.0f} | {ratio:.3f}x |")
    if args.out is not None:
        args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)},
                                        "tok_s": tok_s}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
