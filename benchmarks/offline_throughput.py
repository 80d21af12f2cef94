"""Offline throughput: tokens/s of `resin.LLM.generate` against HF `transformers` `generate()`.

A ~23M-parameter random Llama checkpoint (8 layers, hidden 512, GQA 8/4 heads) is written
once to `benchmarks/results/llama_23m/` (git-ignored) with the tiny fixture tokenizer from
`tests/fixtures/llama`. Each run generates `--output-len` greedy tokens (EOS ignored) after
`--prompt-len`-token random prompts, on CPU in float32 (`--dtype bfloat16`: every contender in
bfloat16, the checkpoint cast on load):

- resin: `LLM.generate` with C concurrent requests (one engine, continuous batching), once per
  attention backend in `--attention-backends` (default: `torch`, the default backend, with its
  CPU paged-attention kernel, and `torch-sdpa`, the same backend with the kernel off,
  `RESIN_TORCH_CPU_KERNEL=0`; `torch-gemm` is the torch backend with the CPU decode linear and
  the packed bfloat16 weights off, every projection torch's plain GEMM; `torch-argmax` the torch backend with the greedy pick
  torch's `argmax`, not `_core.argmax`; `torch-async` the torch backend with
  `async_scheduling` (the next step begun before a step's outputs are returned); `reference`
  is the parity backend);
- HF sequential: `model.generate` one request at a time (C requests);
- HF padded: one `model.generate` call on a left-padded batch of C prompts.

- matmul floor: only the checkpoint's projections (every layer's q/k/v/o and gate/up/down, the
  lm_head at sampled tokens) on the same token counts: the prefill's C x prompt tokens, then
  `output_len - 1` decode steps of C rows, through `resin.kernels.linear` (the Rust decode
  linear for a few rows, torch's GEMM past them): what Resin's own projections cost, so Resin's
  ratio to HF stays under floor / HF.

Throughput = generated tokens / wall seconds. Each contender is built once per concurrency and
timed `--repeats` times, the contenders interleaved and every repeat on fresh prompts (so no
prefix-cache hit; the warm-up prompt is one no repeat uses). Two markdown tables, each
contender's best run (the machine is shared, and interference only ever slows a run) and its
median run; every run is in the JSON.

    .venv/bin/python benchmarks/offline_throughput.py --concurrency 1,8,64
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CHECKPOINT = REPO / "benchmarks" / "results" / "llama_23m"
TOKENIZER_SOURCE = REPO / "tests" / "fixtures" / "llama"


def make_checkpoint() -> Path:
    """Writes the random checkpoint once (seeded, so every run measures the same model)."""
    if (CHECKPOINT / "model.safetensors").exists():
        return CHECKPOINT
    import torch
    import transformers

    vocab_size = json.loads((TOKENIZER_SOURCE / "config.json").read_text())["vocab_size"]
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    CHECKPOINT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(CHECKPOINT, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (TOKENIZER_SOURCE / name).exists():
            shutil.copy(TOKENIZER_SOURCE / name, CHECKPOINT / name)
    return CHECKPOINT


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    # Stay clear of the special tokens at the bottom of the fixture vocabulary.
    return [rng.integers(16, vocab_size, length).tolist() for _ in range(count)]


# A contender: made once per concurrency (model loaded, first-call costs paid), then timed on
# each repeat's prompts: prompts -> generated tokens per second.
Contender = Callable[[list[list[int]]], float]


def resin_contender(
    concurrency: int, output_len: int, backend: str, warmup: list[int], dtype: str = "float32"
) -> Contender:
    import os

    import resin
    import resin.sampling_greedy
    from resin.kernels import cpu_linear
    from resin.llm import LLM

    # torch-sdpa: the torch backend with its CPU kernel off (the padded SDPA batch); torch-gemm:
    # with the CPU decode linear off (every projection torch's GEMM); torch-argmax: with the
    # greedy pick torch's argmax; switched per run.
    sdpa = backend == "torch-sdpa"
    gemm = backend == "torch-gemm"
    torch_argmax = backend == "torch-argmax"
    overlapped = backend == "torch-async"
    if sdpa:
        os.environ["RESIN_TORCH_CPU_KERNEL"] = "0"  # read when the backend is built
    try:
        llm = LLM(
            CHECKPOINT,
            max_num_seqs=max(concurrency, 1),
            max_model_len=1024,
            attention_backend="torch" if sdpa or gemm or torch_argmax or overlapped else backend,
            dtype=dtype,
            async_scheduling=overlapped,
        )
    finally:
        os.environ.pop("RESIN_TORCH_CPU_KERNEL", None)
    params = resin.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate([warmup], params)  # allocator, first-call costs (a prompt no repeat uses)

    def run(prompts: list[list[int]]) -> float:
        enabled, packing = cpu_linear.enabled, cpu_linear.packing
        argmax_kernel = resin.sampling_greedy.argmax_kernel
        cpu_linear.enabled, cpu_linear.packing = enabled and not gemm, packing and not gemm
        resin.sampling_greedy.argmax_kernel = argmax_kernel and not torch_argmax
        try:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
        finally:
            cpu_linear.enabled, cpu_linear.packing = enabled, packing
            resin.sampling_greedy.argmax_kernel = argmax_kernel
        assert all(len(o.token_ids) == output_len for o in outputs)
        return len(prompts) * output_len / seconds

    return run


def matmul_floor_contender(output_len: int, dtype: str = "float32") -> Contender:
    """Tokens/s if only the projections ran (module doc): the lower bound on the time."""
    import torch
    from safetensors.torch import load_file

    from resin.kernels import linear  # what Resin's projections run on (module doc)

    weights = {
        name: w.to(getattr(torch, dtype))
        for name, w in load_file(str(CHECKPOINT / "model.safetensors")).items()
    }
    projections = [w for name, w in weights.items() if name.endswith("proj.weight")]
    lm_head = weights["lm_head.weight"]
    hidden = lm_head.shape[1]

    inputs: dict[tuple[int, int], Any] = {}

    def x(rows: int, width: int) -> Any:
        """Random inputs made once a shape, before the clock starts: drawing them in the timed
        loop (a prefill's [4096, 1376] each layer) had cost as much as the bfloat16 GEMMs."""
        if (rows, width) not in inputs:
            inputs[rows, width] = torch.randn(rows, width, dtype=lm_head.dtype)
        return inputs[rows, width]

    def step(tokens: int, sampled: int) -> None:
        for w in projections:  # input width: hidden, or the MLP width for down_proj
            linear(x(tokens, w.shape[1]), w)
        linear(x(sampled, hidden), lm_head)

    with torch.inference_mode():
        step(1, 1)  # warm-up

    def run(prompts: list[list[int]]) -> float:
        rows, prompt_tokens = len(prompts), sum(len(p) for p in prompts)
        with torch.inference_mode():
            for _ in range(2):  # inputs drawn, first-call costs paid, packed weights packed
                step(prompt_tokens, rows)
                step(rows, rows)
            start = time.perf_counter()
            step(prompt_tokens, rows)
            for _ in range(output_len - 1):
                step(rows, rows)
            seconds = time.perf_counter() - start
        return rows * output_len / seconds

    return run


def hf_contender(
    output_len: int, padded: bool, warmup: list[int], dtype: str = "float32"
) -> Contender:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        CHECKPOINT, dtype=getattr(torch, dtype)
    ).eval()
    kwargs = dict(
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    with torch.inference_mode():
        model.generate(torch.tensor([warmup]), **kwargs)

    def run(prompts: list[list[int]]) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            if padded:
                ids = torch.tensor(prompts)  # equal lengths: no padding needed, mask all ones
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
                assert out.shape[1] == ids.shape[1] + output_len
            else:
                for prompt in prompts:
                    model.generate(torch.tensor([prompt]), **kwargs)
            seconds = time.perf_counter() - start
        return len(prompts) * output_len / seconds

    return run


def print_table(rows: list[dict[str, Any]], backends: list[str]) -> None:
    """One markdown table: tokens/s per contender and the ratios to HF's better mode."""
    head = " | ".join(f"resin {b} tok/s" for b in backends)
    ratios = " | ".join(f"{b} / HF best" for b in backends)
    print(
        f"| concurrent requests | {head} | HF one at a time tok/s | HF padded batch tok/s | "
        f"matmul floor tok/s | {ratios} | floor / HF best |"
    )
    print("|---" * (5 + 2 * len(backends)) + "|")
    for r in rows:
        best = max(r["hf_sequential_tok_s"], r["hf_padded_tok_s"])
        ours = " | ".join(f"{r[f'resin_{b}_tok_s']:.0f}" for b in backends)
        ratio = " | ".join(f"{r[f'resin_{b}_tok_s'] / best:.2f}x" for b in backends)
        print(
            f"| {r['concurrency']} | {ours} | {r['hf_sequential_tok_s']:.0f} | "
            f"{r['hf_padded_tok_s']:.0f} | {r['matmul_floor_tok_s']:.0f} | {ratio} | "
            f"{r['matmul_floor_tok_s'] / best:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,8,64")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--attention-backends", default="torch,torch-sdpa")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="every contender's dtype (the checkpoint is float32; bfloat16 casts it on load)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per contender, interleaved, fresh prompts each; the best is reported",
    )
    parser.add_argument(
        "--output", default=str(REPO / "benchmarks" / "results" / "offline_throughput.json")
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    make_checkpoint()
    vocab_size = json.loads((CHECKPOINT / "config.json").read_text())["vocab_size"]
    rows = []
    backends = args.attention_backends.split(",")
    for c in (int(x) for x in args.concurrency.split(",")):
        warmup = random_prompts(1, args.prompt_len, vocab_size, seed=999_999)[0]
        contenders: dict[str, Contender] = {
            **{
                f"resin_{b}_tok_s": resin_contender(c, args.output_len, b, warmup, args.dtype)
                for b in backends
            },
            "hf_sequential_tok_s": hf_contender(args.output_len, False, warmup, args.dtype),
            "hf_padded_tok_s": hf_contender(args.output_len, True, warmup, args.dtype),
            "matmul_floor_tok_s": matmul_floor_contender(args.output_len, args.dtype),
        }
        runs: dict[str, list[float]] = {name: [] for name in contenders}
        for repeat in range(args.repeats):
            # Fresh prompts per repeat (no prefix-cache hit), the same for every contender.
            prompts = random_prompts(c, args.prompt_len, vocab_size, seed=1000 * c + repeat)
            for name, run in contenders.items():
                runs[name].append(run(prompts))
        row: dict[str, Any] = {"concurrency": c, **{n: max(v) for n, v in runs.items()}}
        row["runs"] = runs
        rows.append(row)
        print(f"C={c}: {runs}", file=sys.stderr)
    print(
        f"prompt {args.prompt_len} tokens, output {args.output_len} tokens, greedy, CPU {args.dtype}, "
        f"23M-param Llama, {args.repeats} interleaved runs each"
    )
    for stat, pick in (("best run", max), ("median run", statistics.median)):
        print(f"\n{stat}:\n")
        print_table([{**r, **{n: pick(v) for n, v in r["runs"].items()}} for r in rows], backends)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps(
            {
                "rows": rows,
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "repeats": args.repeats,
                "dtype": args.dtype,
            },
            indent=2,
        )
    )
    print(f"\nJSON: {args.output}")


if __name__ == "__main__":
    main()
