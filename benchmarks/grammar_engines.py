"""xgrammar vs llguidance on the same JSON-schema grammars and the same synthetic 150k vocabulary.

The structured-output choice (``resin/structured_output.py`` uses xgrammar) measured against
llguidance on what the sampler and the server pay:

1. **mask cost per decode step**: B rows, each a matcher of the same JSON-schema grammar (the
   object of ``benchmarks/structured_output.py``), started 0..40 random allowed tokens in; each
   step fills the token bitmask of every row (timed), then every row takes one random allowed
   token (drawn from xgrammar's mask; both engines consume the same token, so both sit at the
   same grammar position every step). Timed two ways: one row at a time (µs per row), and the
   whole batch with each engine's parallel fill (xgrammar ``BatchGrammarMatcher``, llguidance
   ``LLExecutor``), both with ``--threads`` threads. The bitmask layout is the same for both
   (int32 words, bit i of word i // 32), so the masks are compared row by row too.
2. **compile time of a large tool schema**: ``--tools`` tools (seeded), each an object of
   strings, integers, numbers, booleans, enums, arrays and nested objects, joined as the
   ``anyOf`` of ``{"name": const, "arguments": schema}`` that a forced tool call compiles. Timed:
   schema -> compiled grammar (xgrammar ``compile_json_schema``; llguidance
   ``grammar_from_json_schema`` + ``LLMatcher``), and compile + first mask (llguidance builds
   its lexer lazily, so its first mask carries part of the work xgrammar does up front).

Vocabulary: 256 single-byte tokens, then the BPE-shaped words / punctuation runs / digit runs of
``benchmarks/structured_output.py``'s ``synthetic_vocab``, and an EOS special token; both engines
get the same token bytes (xgrammar ``TokenizerInfo`` RAW over bytes, llguidance ``LLTokenizer``
over a ``TokenizerWrapper``-style object). JSON style as the server's: no free whitespace,
``", "`` / ``": "`` separators, no additional properties.

    .venv/bin/python benchmarks/grammar_engines.py --output benchmarks/results/grammar_engines.json

llguidance is not a project dependency: ``pip install llguidance`` to measure it (without it the
script measures xgrammar only).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_output import SCHEMA, synthetic_vocab  # noqa: E402

try:
    import llguidance as llg
    import llguidance.torch as llg_torch
except ImportError:  # measured without it
    llg = None


# -- the vocabulary ---------------------------------------------------------------------------


def vocab_bytes(size: int) -> list[bytes]:
    """Real single-byte tokens 0..255, then ``synthetic_vocab``'s multi-byte tokens, then EOS."""
    words = synthetic_vocab(size)
    return [bytes([b]) for b in range(256)] + [w.encode() for w in words[256:]]


class _Tokenizer:
    """What ``llguidance.TokenizerWrapper`` needs: token bytes, EOS, and an encoder."""

    def __init__(self, tokens: list[bytes]) -> None:
        self.tokens = tokens
        self.eos_token_id = len(tokens) - 1
        self.bos_token_id = None
        self.special_token_ids = [self.eos_token_id]

        self._ids = {t: i for i, t in enumerate(tokens[:-1])}
        self._longest = max(len(t) for t in tokens[:-1])

    def __call__(self, text: bytes) -> list[int]:
        """Greedy longest match (the vocabulary has no merges; every byte is a token)."""
        out, i = [], 0
        while i < len(text):
            for n in range(min(self._longest, len(text) - i), 0, -1):
                token = self._ids.get(bytes(text[i : i + n]))
                if token is not None:
                    out.append(token)
                    i += n
                    break
        return out


# -- the schemas ------------------------------------------------------------------------------


def strict(schema: Any) -> Any:
    """``additionalProperties: false`` on every object (xgrammar's strict mode, for both)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if out.get("type") == "object":
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 10)))


def _value_schema(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "array_str", "array_int"]
    if depth < 2:
        kinds += ["object", "object", "array_obj"]
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"type": "string", "enum": [_word(rng) for _ in range(rng.randint(3, 8))]}
    if kind == "array_str":
        return {"type": "array", "items": {"type": "string"}}
    if kind == "array_int":
        return {"type": "array", "items": {"type": "integer"}}
    if kind == "object":
        return _object_schema(rng, depth + 1, rng.randint(2, 4))
    if kind == "array_obj":
        return {"type": "array", "items": _object_schema(rng, depth + 1, rng.randint(2, 3))}
    return {"type": kind, "description": f"the {_word(rng)}"}


def _object_schema(rng: random.Random, depth: int, size: int) -> dict:
    names = list(dict.fromkeys(_word(rng) for _ in range(size)))
    properties = {name: _value_schema(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.6] or names[:1]
    return {"type": "object", "properties": properties, "required": required}


def tool_schema(num_tools: int, seed: int = 0) -> dict:
    """The forced-tool-call schema of ``num_tools`` random tools (as ``GrammarCompiler.tool_call``)."""
    rng = random.Random(seed)
    options = []
    for index in range(num_tools):
        options.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": f"tool_{index}_{_word(rng)}"},
                    "arguments": _object_schema(rng, 0, rng.randint(3, 8)),
                },
                "required": ["name", "arguments"],
            }
        )
    return strict({"anyOf": options})


# -- the engines ------------------------------------------------------------------------------

XGR_STYLE = {"any_whitespace": False, "separators": (", ", ": "), "strict_mode": True}
LLG_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Xgr:
    name = "xgrammar"

    def __init__(self, tokens: list[bytes], threads: int) -> None:
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, stop_token_ids=[len(tokens) - 1])
        self.tokenizer_s = time.perf_counter() - t0
        self.threads = threads
        self.vocab = len(tokens)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: dict) -> Any:
        compiler = xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), **XGR_STYLE)

    def matcher(self, compiled: Any) -> Any:
        return xgr.GrammarMatcher(compiled)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def fill_one(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask, list(range(len(matchers))))


class Llg:
    name = "llguidance"

    def __init__(self, tokens: list[bytes], threads: int) -> None:
        t0 = time.perf_counter()
        self.tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(_Tokenizer(tokens)))
        self.tokenizer_s = time.perf_counter() - t0
        self.vocab = len(tokens)
        self.executor = llg.LLExecutor(num_threads=threads)

    def compile(self, schema: dict) -> Any:
        grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=LLG_STYLE)
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return grammar

    def matcher(self, grammar: str) -> Any:
        return llg.LLMatcher(self.tokenizer, grammar, log_level=0)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def fill_one(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        llg_torch.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        llg_torch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )


# -- the measurements -------------------------------------------------------------------------


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    """[rows, vocab] bool from an int32 bitmask."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab].astype(bool)


def mask_cost(engines: list, rows: int, steps: int, seed: int, sample: int = 32) -> dict:
    """Per-step fill cost at ``rows`` rows, every engine on the same token paths.

    A mask is timed only on its first fill at a matcher state (llguidance caches the mask of
    the current state: a second fill is ~5 µs): the batch fill on the rows' matchers, the
    one-row fill on shadow matchers of the first ``sample`` rows that take the same tokens."""
    vocab = engines[0].vocab
    eos = vocab - 1
    schema = strict(SCHEMA)
    grammars = [e.compile(schema) for e in engines]
    rng = random.Random(seed)
    masks = [xgr.allocate_token_bitmask(rows, vocab) for _ in engines]
    scratch = xgr.allocate_token_bitmask(1, vocab)
    sample = min(sample, rows)

    def fresh() -> list:
        return [e.matcher(g) for e, g in zip(engines, grammars)]

    matchers = [fresh() for _ in range(rows)]  # matchers[row][engine]
    shadows = [fresh() for _ in range(sample)]
    warm = [rng.randint(0, 40) for _ in range(rows)]
    one = {e.name: [] for e in engines}
    batch = {e.name: [] for e in engines}
    same_rows = {e.name: [0, 0] for e in engines[1:]}
    diff_bits = {e.name: [0, 0] for e in engines[1:]}
    diverged = 0

    def advance(active: list[int], record: bool) -> None:
        nonlocal diverged
        for k, engine in enumerate(engines):
            if record:
                for r in active[:sample]:
                    t0 = time.perf_counter()
                    engine.fill_one(shadows[r][k], scratch, 0)
                    one[engine.name].append(time.perf_counter() - t0)
            ms = [matchers[r][k] for r in active]
            t0 = time.perf_counter()
            engine.fill_batch(ms, masks[k][: len(active)])
            t1 = time.perf_counter()
            if record:
                batch[engine.name].append((t1 - t0) / len(active))
        allowed = [allowed_tokens(m[: len(active)], vocab)[:, :eos] for m in masks]
        for k, engine in enumerate(engines[1:], start=1):
            differ = allowed[k] != allowed[0]
            same_rows[engine.name][0] += int((~differ.any(axis=1)).sum())
            same_rows[engine.name][1] += len(active)
            diff_bits[engine.name][0] += int(differ.sum())
            diff_bits[engine.name][1] += int(allowed[0].sum())
        for i, r in enumerate(active):
            choices = np.flatnonzero(allowed[0][i])
            if len(choices) == 0:  # the grammar is done: a new request in this row
                matchers[r] = fresh()
                if r < sample:
                    shadows[r] = fresh()
                continue
            token = int(choices[rng.randrange(len(choices))])
            ok = [e.consume(m, token) for e, m in zip(engines, matchers[r])]
            if r < sample:
                ok += [e.consume(m, token) for e, m in zip(engines, shadows[r])]
            if not all(ok):  # an engine rejects a token xgrammar allows: restart the row
                diverged += 1
                matchers[r] = fresh()
                if r < sample:
                    shadows[r] = fresh()

    for depth in range(max(warm)):  # warm-up: row r takes warm[r] tokens
        active = [r for r in range(rows) if warm[r] > depth]
        for r in range(sample):  # shadows follow their rows (their masks are not read)
            if warm[r] > depth:
                for e, m in zip(engines, shadows[r]):
                    e.fill_one(m, scratch, 0)
        advance(active, record=False)
    for _ in range(steps):
        advance(list(range(rows)), record=True)
    out: dict[str, Any] = {}
    for e in engines:
        out[e.name] = {
            "one_row_us": statistics.median(one[e.name]) * 1e6,
            "one_row_mean_us": statistics.mean(one[e.name]) * 1e6,
            "one_row_p90_us": float(np.percentile(one[e.name], 90)) * 1e6,
            "batch_us_per_row": statistics.median(batch[e.name]) * 1e6,
            "batch_ms": statistics.median(batch[e.name]) * rows * 1e3,
        }
        if e.name in same_rows:
            out[e.name]["rows_same_mask_as_xgrammar"] = same_rows[e.name][0] / same_rows[e.name][1]
            out[e.name]["bits_differing_per_xgrammar_allowed"] = diff_bits[e.name][0] / max(
                diff_bits[e.name][1], 1
            )
    out["tokens_rejected_by_an_engine"] = diverged
    return out


def compile_cost(engines: list, schema: dict, repeats: int) -> dict:
    out = {}
    vocab = engines[0].vocab
    for engine in engines:
        compile_s, first_s = [], []
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        for _ in range(repeats):
            t0 = time.perf_counter()
            compiled = engine.compile(copy.deepcopy(schema))
            t1 = time.perf_counter()
            engine.fill_one(engine.matcher(compiled), bitmask, 0)
            t2 = time.perf_counter()
            compile_s.append(t1 - t0)
            first_s.append(t2 - t0)
        out[engine.name] = {
            "compile_s": statistics.median(compile_s),
            "compile_first_mask_s": statistics.median(first_s),
            "tokenizer_s": engine.tokenizer_s,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=150_000)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--tools", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    tokens = vocab_bytes(args.vocab)
    engines: list = [Xgr(tokens, args.threads)]
    if llg is not None:
        engines.append(Llg(tokens, args.threads))
    schema = tool_schema(args.tools, args.seed)
    compiled = compile_cost(engines, schema, args.repeats)
    masks = mask_cost(engines, args.rows, args.steps, args.seed)

    print(f"vocab {len(tokens)}, rows {args.rows}, {args.steps} steps, {args.threads} threads")
    print(
        f"{'engine':>10} {'tok init s':>10} {'1 row us':>9} {'p90 us':>8} "
        f"{f'{args.rows} rows ms':>12} {'us/row':>7} {'same':>6} "
        f"{f'{args.tools} tools s':>12} {'+1st mask s':>11}"
    )
    for engine in engines:
        m, c = masks[engine.name], compiled[engine.name]
        print(
            f"{engine.name:>10} {c['tokenizer_s']:>10.2f} {m['one_row_us']:>9.1f} "
            f"{m['one_row_p90_us']:>8.1f} {m['batch_ms']:>12.2f} {m['batch_us_per_row']:>7.1f} "
            f"{m.get('rows_same_mask_as_xgrammar', 1.0):>6.3f} {c['compile_s']:>12.3f} {c['compile_first_mask_s']:>11.3f}"
        )
    for engine in engines[1:]:
        m = masks[engine.name]
        print(
            f"{engine.name}: {m['rows_same_mask_as_xgrammar']:.1%} of row masks identical to "
            f"xgrammar's; differing bits {m['bits_differing_per_xgrammar_allowed']:.2e} of "
            f"xgrammar's allowed tokens; tokens xgrammar allowed and it rejected: "
            f"{masks['tokens_rejected_by_an_engine']}"
        )
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        versions = {"xgrammar": metadata.version("xgrammar")}
        if llg is not None:
            versions["llguidance"] = metadata.version("llguidance")
        args.output.write_text(
            json.dumps(
                {
                    "args": {
                        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                    },
                    "versions": versions,
                    "tool_schema_bytes": len(json.dumps(schema)),
                    "mask": masks,
                    "compile": compiled,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
