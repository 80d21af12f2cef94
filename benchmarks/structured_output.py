"""Cost of the structured-output mask per decode step: fill + apply the token bitmask for B rows.

For each vocabulary (the Qwen3 test fixture's 384 tokens, and a synthetic 150k-token vocabulary
shaped like a BPE one: single bytes, space-prefixed words, punctuation runs, digits) it compiles
a JSON-schema grammar (an object with strings, an integer, an enum, a boolean and an array),
advances B matchers to different positions (random allowed tokens, per row), and times what
:class:`resin.sampling.Sampler` does per step for B grammar rows: fill the bitmask (xgrammar's
batch fill, multithreaded) and apply it to float32 logits [B, vocab] on the CPU
(``resin.structured_output.apply_grammar_masks``). Rows are re-randomised between repeats.

    .venv/bin/python benchmarks/structured_output.py --rows 256 --output results/structured.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time
from pathlib import Path

import torch
import xgrammar as xgr

from resin.structured_output import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarSlot,
    MaskBuffer,
    apply_grammar_masks,
    fill_bitmask,
)
from resin.tokenizer import Tokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "active", "tags"],
}


def synthetic_vocab(size: int, seed: int = 0) -> list[str]:
    """A BPE-like vocabulary: 256 byte tokens, then unique words / punctuation / digit runs."""
    rng = random.Random(seed)
    vocab = [chr(b) if 32 <= b < 127 else f"<0x{b:02X}>" for b in range(256)]
    seen = set(vocab)
    letters = string.ascii_lowercase
    punct = ['"', "{", "}", ":", ",", "[", "]", '":', '",', '{"', '"}', " {", " [", "\n", "  "]
    while len(vocab) < size - 1:
        kind = rng.random()
        if kind < 0.55:
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
            token = (" " if rng.random() < 0.6 else "") + (
                word.capitalize() if rng.random() < 0.2 else word
            )
        elif kind < 0.75:
            token = "".join(rng.choice(punct) for _ in range(rng.randint(1, 3)))
        elif kind < 0.9:
            token = "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 3)))
        else:
            token = "".join(rng.choice(string.printable[:94]) for _ in range(rng.randint(2, 6)))
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    vocab.append("<|endoftext|>")
    return vocab


def compiler_for(name: str) -> GrammarCompiler:
    if name == "fixture":
        tokenizer = Tokenizer.from_pretrained(FIXTURE)
        return GrammarCompiler(tokenizer, 384, tokenizer.eos_token_ids)
    size = int(name.removesuffix("k")) * 1000
    vocab = synthetic_vocab(size)
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[len(vocab) - 1])
    return GrammarCompiler.from_info(info)


def random_slots(grammar: CompiledGrammar, rows: int, vocab: int, rng: random.Random) -> list:
    """``rows`` matchers, each advanced 0..40 random allowed tokens into the grammar."""
    slots = []
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for _ in range(rows):
        slot = GrammarSlot(grammar)
        for _ in range(rng.randint(0, 40)):
            slot.matcher.fill_next_token_bitmask(bitmask, 0)
            logits = torch.zeros(1, vocab)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            allowed = torch.isfinite(logits[0]).nonzero()[:, 0].tolist()
            allowed = [t for t in allowed if t not in grammar.stop_token_ids]
            if not allowed:
                break
            slot.matcher.accept_token(rng.choice(allowed))
        slots.append(slot)
    return slots


def bench(name: str, rows: int, repeats: int, steps: int) -> dict:
    t0 = time.perf_counter()
    compiler = compiler_for(name)
    info_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = compiler.json_schema(SCHEMA, "schema")
    compile_s = time.perf_counter() - t0
    vocab = compiler.vocab_size
    rng = random.Random(1)
    buffer = MaskBuffer(vocab)
    logits = torch.randn(rows, vocab)
    indices = list(range(rows))
    fill, apply, total = [], [], []
    for _ in range(repeats):
        slots = random_slots(grammar, rows, vocab, rng)
        for _ in range(steps):
            bitmask = buffer.get(rows)
            t0 = time.perf_counter()
            fill_bitmask(slots, bitmask, indices)
            t1 = time.perf_counter()
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
            t2 = time.perf_counter()
            apply_grammar_masks(logits, indices, slots, buffer)
            t3 = time.perf_counter()
            fill.append(t1 - t0)
            apply.append(t2 - t1)
            total.append(t3 - t2)
    return {
        "vocab": name,
        "vocab_size": vocab,
        "rows": rows,
        "tokenizer_info_s": info_s,
        "compile_s": compile_s,
        "fill_ms": statistics.median(fill) * 1e3,
        "apply_ms": statistics.median(apply) * 1e3,
        "mask_ms": statistics.median(total) * 1e3,
        "mask_us_per_row": statistics.median(total) * 1e6 / rows,
        "samples": len(total),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocabs", default="fixture,150k")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    results = [bench(v, args.rows, args.repeats, args.steps) for v in args.vocabs.split(",")]
    header = (
        f"{'vocab':>8} {'size':>7} {'rows':>5} {'compile s':>9} {'fill ms':>8} "
        f"{'apply ms':>8} {'mask ms':>8} {'us/row':>7}"
    )
    print(header)
    for r in results:
        print(
            f"{r['vocab']:>8} {r['vocab_size']:>7} {r['rows']:>5} {r['compile_s']:>9.3f} "
            f"{r['fill_ms']:>8.3f} {r['apply_ms']:>8.3f} {r['mask_ms']:>8.3f} "
            f"{r['mask_us_per_row']:>7.2f}"
        )
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(
            json.dumps({"torch_threads": torch.get_num_threads(), "results": results}, indent=2)
            + "\n"
        )


if __name__ == "__main__":
    main()
