#!/usr/bin/env bash
# A/B `resin bench` of two trees on the same machine, alternating, 2 rounds each:
#   git worktree add /tmp/old COMMIT && (build its resin/_core.abi3.so there, e.g.
#   CARGO_TARGET_DIR=/tmp/old/target maturin build --release -o /tmp/oldwheel, unzip the .so)
#   benchmarks/ab_bench.sh /tmp/old [OUT_DIR]
# Each run: resin bench tests/fixtures/llama with the committed suite and baseline.
set -euo pipefail
OLD=${1:?usage: ab_bench.sh OLD_TREE [OUT_DIR]}
NEW=$(cd "$(dirname "$0")/.." && pwd)
OUT=${2:-/tmp/ab}
PY="$NEW/.venv/bin/python"
mkdir -p "$OUT"
for round in 1 2; do
  for side in old new; do
    dir=$([ "$side" = old ] && echo "$OLD" || echo "$NEW")
    (cd "$dir" && PYTHONPATH="$dir" "$PY" -c "from resin.cli import main; main()" bench \
        "$NEW/tests/fixtures/llama" --spec "$NEW/evals/perf/suites/llama.toml" \
        --out "$OUT/$side-$round" \
        --baseline "$NEW/evals/perf/baselines/llama/cpu-float32/report.json" \
        > "$OUT/$side-$round.log" 2>&1 || true)
    tail -2 "$OUT/$side-$round.log"
  done
done
