"""Speculative decoding with the n-gram drafter: tokens/s and acceptance, against it off.

The ~23M-parameter random Llama of `offline_throughput.py` (written once to
`benchmarks/results/llama_23m/`), CPU float32, `resin.LLM.generate`, greedy, EOS ignored. The
workload is repetitive the way code editing is (the prompt's text re-emitted): each prompt is a
48-token phrase repeated three times, and random-weight greedy decoding falls into loops the
drafter can follow. Per concurrency and `num_speculative_tokens` (0 = off), one run each after a
warm-up, all in one process: tokens/s, mean accepted drafts per verify row and mean tokens
committed per verify row (accepted + 1). The outputs must equal the run with speculation off
(checked).

    .venv/bin/python benchmarks/speculative_ngram.py          # prints a table, writes results/speculative_ngram.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import CHECKPOINT, make_checkpoint, random_prompts  # noqa: E402

import resin  # noqa: E402
from resin.llm import LLM  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def metric(llm: LLM, name: str) -> float:
    match = re.search(rf"^resin:{name}(?:\{{\}})? (\S+)", llm.engine.metrics_text(), re.M)
    return float(match.group(1)) if match else 0.0


def run(prompts: list[list[int]], k: int, output_len: int) -> dict:
    llm = LLM(CHECKPOINT, max_num_seqs=len(prompts), max_model_len=1024, num_speculative_tokens=k)
    params = resin.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], params)  # warm-up
    before = {
        n: metric(llm, n)
        for n in ("spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_total")
    }
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    drafts = metric(llm, "spec_decode_num_drafts_total") - before["spec_decode_num_drafts_total"]
    accepted = (
        metric(llm, "spec_decode_num_accepted_tokens_total")
        - before["spec_decode_num_accepted_tokens_total"]
    )
    return {
        "k": k,
        "tok_s": len(prompts) * output_len / seconds,
        "verify_rows": drafts,
        "accepted_per_row": accepted / drafts if drafts else 0.0,
        "tokens": [o.token_ids for o in outputs],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--k", default="0,2,4")
    parser.add_argument("--output-len", type=int, default=96)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    make_checkpoint()
    vocab = json.loads((CHECKPOINT / "config.json").read_text())["vocab_size"]
    rows = []
    for c in (int(x) for x in args.concurrency.split(",")):
        prompts = [p * 3 for p in random_prompts(c, 48, vocab, seed=c)]
        base = None
        for k in (int(x) for x in args.k.split(",")):
            r = run(prompts, k, args.output_len)
            if base is None:
                base = r
            assert r["tokens"] == base["tokens"], f"C={c} k={k}: outputs differ from k={base['k']}"
            r.update(concurrency=c, speedup=r["tok_s"] / base["tok_s"])
            rows.append(r)
            print(f"C={c} k={k}: {r['tok_s']:.0f} tok/s", file=sys.stderr)
    print(
        f"n-gram speculative decoding, 23M Llama, CPU float32, greedy, {args.output_len} tokens\n"
    )
    print(
        "| concurrent requests | k | tok/s | vs k=0 | verify rows | accepted drafts per row | tokens per verify row |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        per_row = r["accepted_per_row"] + 1 if r["verify_rows"] else 1.0
        print(
            f"| {r['concurrency']} | {r['k']} | {r['tok_s']:.0f} | {r['speedup']:.2f}x "
            f"| {r['verify_rows']:.0f} | {r['accepted_per_row']:.2f} | {per_row:.2f} |"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "speculative_ngram.json"
    out.write_text(
        json.dumps([{k: v for k, v in r.items() if k != "tokens"} for r in rows], indent=2) + "\n"
    )
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
