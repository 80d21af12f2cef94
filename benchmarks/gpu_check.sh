#!/usr/bin/env bash
# The GPU check: Resin on a fresh CUDA machine, from a bundle built elsewhere, in one command.
#
#   benchmarks/gpu_check.sh [--bundle DIR] [--out DIR] [--deadline SECONDS] [--python PY]
#                           [--steps install,checkpoints,unit,parity,graphs,bench8b,async]
#
# The machine needs a CUDA GPU and a Python 3.11+ with torch (CUDA), triton, transformers and
# pytest; no network and no Rust toolchain. The bundle (benchmarks/gpu_check_bundle.sh, default
# ./.gpu_bundle next to this repository, or the directory holding this script when it is the
# bundle's copy) carries the abi3 Resin wheel, the wheels of its runtime dependencies for
# Python 3.12 / manylinux x86_64, optionally FlashInfer and the CUTLASS DSL with the packages
# they import, and the GPU tests. Steps, each timed into OUT/steps.tsv, each within what is
# left of --deadline (default 480 s; a step that cannot fit is skipped and says so):
#
#   install      a venv over the system packages (torch stays the machine's), Resin and its
#                missing dependencies from the bundle (pip --no-index), the CUDA extras
#                (--no-deps); pieces of split wheels are joined first
#   checkpoints  tiny random Llama and Mistral (sliding window 24) checkpoints with transformers
#                (head_dim 128: FlashInfer has kernels for it)
#   unit         (background, from here on) the GPU tests: FlashInfer's wrappers against the
#                reference backend (GQA, window, softcap, sinks), the CUTLASS GEMM against
#                torch.matmul; it also warms FlashInfer's JIT cache for the parity runs
#   parity       resin eval parity, bf16 on CUDA: tiny Llama on the torch, triton and flashinfer
#                backends, tiny Mistral on triton and flashinfer; FlashInfer's own count of the
#                calls it ran and those it handed to the torch backend is kept beside each run
#   graphs       resin bench on the tiny Llama (triton backend) with CUDA graphs and with
#                --enforce-eager; a build without --enforce-eager runs once and says so
#   bench8b      an 8B-shaped Llama with random bf16 weights drawn on the GPU (hidden 4096, 32
#                layers, 32 / 8 heads, MLP 14336, vocab 128256), resin bench decode:1,64@512:
#                decode at batch 1 as % of the roofline (HBM-bound), tokens/s at batch 64
#   async        resin.LLM on the tiny Llama (triton, CUDA graphs), 64 requests, async_scheduling
#                off and on, interleaved: tokens/s of each and the same tokens from both
#                (gpu_check/async_scheduling.py; last, so it never crowds out bench8b)
#
# Results: OUT (default $OUT, else ./gpu_check_out): steps.tsv, log.txt, every step's log and
# JSON, summary.json and the last table (benchmarks/gpu_check/summarize.py). Exit 0 when every
# step that ran passed, 1 when one failed, 2 when there is no CUDA device (nothing is done).
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STARTED=$(date +%s)
BUNDLE=${GPU_CHECK_BUNDLE:-}
OUT_DIR=${GPU_CHECK_OUT:-${OUT:-$PWD/gpu_check_out}}
DEADLINE=${GPU_CHECK_DEADLINE:-480}
PYTHON=${GPU_CHECK_PYTHON:-python3}
STEPS=install,checkpoints,unit,parity,graphs,bench8b,async
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/resin_gpu_check}

while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) BUNDLE=$2; shift 2 ;;
        --out) OUT_DIR=$2; shift 2 ;;
        --deadline) DEADLINE=$2; shift 2 ;;
        --python) PYTHON=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        --work) WORK=$2; shift 2 ;;
        -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

mkdir -p "$OUT_DIR" "$WORK"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
: > "$OUT_DIR/steps.tsv"
FAILED=0

elapsed() { echo $(($(date +%s) - STARTED)); }
left() { echo $((DEADLINE - $(elapsed))); }
log() { printf '[gpu_check %4ss] %s\n' "$(elapsed)" "$*" | tee -a "$OUT_DIR/log.txt"; }
want() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$OUT_DIR/steps.tsv"; }

# run NAME BUDGET_S MIN_S LOGFILE CMD...: CMD under `timeout min(BUDGET, time left)`, skipped
# when less than MIN_S is left; its status and seconds go to steps.tsv.
run() {
    local name=$1 budget=$2 min=$3 logfile=$4
    shift 4
    local remaining
    remaining=$(left)
    if [ "$remaining" -lt "$min" ]; then
        log "$name: SKIPPED (${remaining}s left of the ${DEADLINE}s deadline, needs ${min}s)"
        record "$name" skipped 0 "time: ${remaining}s left"
        return 0
    fi
    [ "$budget" -gt "$remaining" ] && budget=$remaining
    log "$name: start (timeout ${budget}s)"
    local t0 rc
    t0=$(date +%s)
    if declare -F "$1" > /dev/null; then  # a function of this script: no timeout(1) for it
        (cd "$WORK" && "$@") > "$logfile" 2>&1
    else
        (cd "$WORK" && timeout "$budget" "$@") > "$logfile" 2>&1
    fi
    rc=$?
    local took=$(($(date +%s) - t0))
    if [ $rc -eq 0 ]; then
        log "$name: ok (${took}s)"
        record "$name" ok "$took" "$(basename "$logfile")"
    else
        local why="exit $rc"
        [ $rc -eq 124 ] && why="timed out after ${budget}s"
        log "$name: FAILED ($why, ${took}s): last lines of $logfile:"
        tail -n 15 "$logfile" | sed 's/^/    /' | tee -a "$OUT_DIR/log.txt"
        record "$name" FAILED "$took" "$why"
        FAILED=1
    fi
    return $rc
}

# -- preflight: a CUDA device, or stop before touching anything --------------------------------
if ! "$PYTHON" - > "$OUT_DIR/preflight.txt" 2>&1 <<'EOF'
import os, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda)
if not torch.cuda.is_available():
    print("NO_CUDA")
    # GPU_CHECK_ALLOW_CPU=1: go on without a GPU, for the repository's CPU test of the install
    # step only; every other step needs CUDA.
    sys.exit(0 if os.environ.get("GPU_CHECK_ALLOW_CPU") == "1" else 3)
print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("memory_gib", round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
EOF
then
    cat "$OUT_DIR/preflight.txt" >&2
    if grep -q NO_CUDA "$OUT_DIR/preflight.txt"; then
        echo "gpu_check: no CUDA device (torch.cuda.is_available() is False for $PYTHON):" \
            "this check needs a CUDA GPU; stopped before installing anything" | tee -a "$OUT_DIR/log.txt" >&2
    else
        echo "gpu_check: $PYTHON cannot import torch: this check needs the machine's CUDA" \
            "torch (pass --python); stopped before installing anything" | tee -a "$OUT_DIR/log.txt" >&2
    fi
    record preflight "no CUDA" "$(elapsed)" "see preflight.txt"
    exit 2
fi
log "preflight: $(tr '\n' ';' < "$OUT_DIR/preflight.txt")"
grep -q NO_CUDA "$OUT_DIR/preflight.txt" && log "no CUDA device: GPU_CHECK_ALLOW_CPU=1, going on"
# FlashInfer compiles its kernels on first use with nvcc (CUDA_HOME, else PATH).
if ! command -v nvcc > /dev/null && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
    export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
fi
command -v nvcc > /dev/null && log "nvcc: $(nvcc --version | tail -n 2 | head -n 1)" ||
    log "nvcc: not found (FlashInfer compiles its kernels with it: its steps will fail)"

# -- the bundle ----------------------------------------------------------------------------------
if [ -z "$BUNDLE" ]; then
    for candidate in "$HERE" "$HERE/../.gpu_bundle" "$PWD/.gpu_bundle"; do
        if [ -d "$candidate/wheels/resin" ]; then BUNDLE=$candidate; break; fi
    done
fi
VENV=$WORK/venv
VPY=$VENV/bin/python
RESIN=$VENV/bin/resin

install() {
    [ -n "$BUNDLE" ] && [ -d "$BUNDLE/wheels/resin" ] || {
        echo "no bundle: pass --bundle DIR (made by benchmarks/gpu_check_bundle.sh)"
        return 1
    }
    # Pieces of wheels split to fit a transfer limit: NAME.whl.part-aa, -ab, ... -> NAME.whl
    find "$BUNDLE/wheels" -name '*.whl.part-aa' | while read -r first; do
        local whole=${first%.part-aa}
        [ -f "$whole" ] || cat "${whole}".part-* > "$whole"
        echo "joined $(basename "$whole")"
    done
    # A venv of our own that sees the machine's packages (torch above all): the machine's
    # python3 may itself be a venv, whose packages --system-site-packages would not reach, so
    # a .pth line adds its site-packages (site.addsitedir: their own .pth files run too).
    # Ours come first on sys.path; pip sees theirs as installed.
    "$PYTHON" -m venv --system-site-packages "$VENV" || return 1
    "$PYTHON" -c 'import site; print("import site; " + "; ".join(
        f"site.addsitedir({p!r})" for p in site.getsitepackages()))' \
        > "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_machine.pth"
    # The bundle's Resin always (the machine may have another), then only the dependencies
    # the machine lacks.
    "$VPY" -m pip install -q --no-index --no-deps --force-reinstall "$BUNDLE"/wheels/resin/*.whl ||
        return 1
    "$VPY" -m pip install -q --no-index --find-links "$BUNDLE/wheels/core" resin || return 1
    if compgen -G "$BUNDLE/wheels/cuda/*.whl" > /dev/null; then
        "$VPY" -m pip install -q --no-index --no-deps "$BUNDLE"/wheels/cuda/*.whl || return 1
    else
        echo "no CUDA extras in the bundle: flashinfer / CUTLASS steps use what the machine has"
    fi
    "$VPY" - <<'EOF'
import importlib.util
import resin, resin._core
print("resin", resin.__file__)
for name in ("flashinfer", "cutlass", "triton", "transformers"):
    print(name, "installed" if importlib.util.find_spec(name) else "MISSING")
EOF
}

if want install; then
    run install 180 30 "$OUT_DIR/install.log" install || { log "cannot go on without Resin"; exit 1; }
    cat "$OUT_DIR/install.log" >> "$OUT_DIR/log.txt"
else
    VPY=$PYTHON
    RESIN=$(command -v resin || echo resin)
fi
has() { "$VPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }

# -- tiny checkpoints ------------------------------------------------------------------------
MAKE="$HERE/gpu_check/make_checkpoint.py"
[ -f "$MAKE" ] || MAKE="$BUNDLE/gpu_check/make_checkpoint.py"
if want checkpoints; then
    run checkpoint:tiny-llama 120 20 "$OUT_DIR/checkpoint-tiny-llama.log" \
        "$VPY" "$MAKE" tiny-llama "$WORK/tiny-llama"
    run checkpoint:tiny-mistral 120 20 "$OUT_DIR/checkpoint-tiny-mistral.log" \
        "$VPY" "$MAKE" tiny-mistral "$WORK/tiny-mistral"
fi

# -- unit tests, in the background (they warm FlashInfer's JIT cache too) --------------------------
UNIT_PID=
TESTS="$BUNDLE/tests"
[ -d "$TESTS" ] || TESTS="$HERE/../tests"
if want unit; then
    mkdir -p "$WORK/tests"
    cp "$TESTS/conftest.py" "$TESTS/test_flashinfer_backend.py" "$TESTS/test_cutlass_kernels.py" \
        "$WORK/tests/" 2> /dev/null
    budget=$(($(left) - 20))
    if [ "$budget" -lt 60 ]; then
        log "unit: SKIPPED (${budget}s left)"
        record unit skipped 0 "time"
    else
        log "unit: start in the background (timeout ${budget}s)"
        UNIT_T0=$(date +%s)
        (cd "$WORK" && timeout "$budget" "$VPY" -m pytest -q -p no:cacheprovider -rs \
            tests/test_flashinfer_backend.py tests/test_cutlass_kernels.py) > "$OUT_DIR/unit.log" 2>&1 &
        UNIT_PID=$!
    fi
fi

# -- parity on the CUDA backends -------------------------------------------------------------------
parity() {  # NAME CHECKPOINT BACKEND
    local name=$1 checkpoint=$2 backend=$3
    if [ "$backend" = flashinfer ] && ! has flashinfer; then
        log "parity $name: SKIPPED (flashinfer-python is not installed: the bundle has no CUDA extras)"
        record "parity:$name" skipped 0 "flashinfer not installed"
        return 0
    fi
    [ -d "$checkpoint" ] || { record "parity:$name" skipped 0 "no checkpoint"; return 0; }
    RESIN_FLASHINFER_STATS="$OUT_DIR/flashinfer-stats-$name.json" run "parity:$name" 240 45 \
        "$OUT_DIR/parity-$name.log" "$RESIN" eval parity "$checkpoint" --device cuda \
        --dtype bfloat16 --attention-backend "$backend" --json "$OUT_DIR/parity-$name.json"
    if [ -f "$OUT_DIR/flashinfer-stats-$name.json" ]; then
        log "parity $name: FlashInfer calls $(tr -d '\n ' < "$OUT_DIR/flashinfer-stats-$name.json")"
    fi
}
if want parity; then
    parity tiny-llama-torch "$WORK/tiny-llama" torch
    parity tiny-llama-triton "$WORK/tiny-llama" triton
    parity tiny-llama-flashinfer "$WORK/tiny-llama" flashinfer
    parity tiny-mistral-triton "$WORK/tiny-mistral" triton
    parity tiny-mistral-flashinfer "$WORK/tiny-mistral" flashinfer
fi

# -- CUDA graphs: capture / replay against eager ------------------------------------------------------
BENCH_COMMON=(--device cuda --dtype bfloat16 --attention-backend triton)
if want graphs && [ -d "$WORK/tiny-llama" ]; then
    if "$RESIN" bench --help 2>&1 | grep -q -- '--enforce-eager'; then
        run graphs:captured 150 40 "$OUT_DIR/bench-graphs.log" "$RESIN" bench "$WORK/tiny-llama" \
            "${BENCH_COMMON[@]}" --shapes 'decode:1,8@128' --repeats 10 --warmup 2 \
            --out "$OUT_DIR/bench-graphs"
        run graphs:eager 150 40 "$OUT_DIR/bench-eager.log" "$RESIN" bench "$WORK/tiny-llama" \
            "${BENCH_COMMON[@]}" --shapes 'decode:1,8@128' --repeats 10 --warmup 2 \
            --enforce-eager --out "$OUT_DIR/bench-eager"
    else
        log "graphs: this build's resin bench has no --enforce-eager (CUDA graphs not in it yet):" \
            "one eager run, no capture / replay to compare"
        run graphs:eager-only 150 40 "$OUT_DIR/bench-eager.log" "$RESIN" bench "$WORK/tiny-llama" \
            "${BENCH_COMMON[@]}" --shapes 'decode:1,8@128' --repeats 10 --warmup 2 \
            --out "$OUT_DIR/bench-eager"
        record graphs:captured skipped 0 "no --enforce-eager in this build"
    fi
fi

# -- the 8B-shaped bench ---------------------------------------------------------------------------
if want bench8b; then
    if run checkpoint:llama-8b 180 60 "$OUT_DIR/checkpoint-llama-8b.log" \
        "$VPY" "$MAKE" llama-8b "$WORK/llama-8b" --device cuda; then
        run bench:llama-8b 300 90 "$OUT_DIR/bench-llama-8b.log" "$RESIN" bench "$WORK/llama-8b" \
            "${BENCH_COMMON[@]}" --shapes 'decode:1,64@512' --repeats 10 --warmup 3 \
            --out "$OUT_DIR/bench-llama-8b"
    fi
fi

# -- overlapped scheduling, off and on -------------------------------------------------------------
ASYNC_AB="$HERE/gpu_check/async_scheduling.py"
[ -f "$ASYNC_AB" ] || ASYNC_AB="$BUNDLE/gpu_check/async_scheduling.py"
if want async && [ -d "$WORK/tiny-llama" ]; then
    if [ -f "$ASYNC_AB" ]; then
        run async 150 40 "$OUT_DIR/async.log" "$VPY" "$ASYNC_AB" "$WORK/tiny-llama" \
            --out "$OUT_DIR/async.json"
    else
        record async skipped 0 "no gpu_check/async_scheduling.py in this build"
    fi
fi

# -- collect the unit tests ------------------------------------------------------------------------
if [ -n "$UNIT_PID" ]; then
    wait "$UNIT_PID"
    rc=$?
    took=$(($(date +%s) - UNIT_T0))
    tail_line=$(grep -E '[0-9]+ (passed|failed)' "$OUT_DIR/unit.log" | tail -n 1)
    if [ $rc -eq 0 ]; then
        log "unit: ok (${took}s): $tail_line"
        record unit ok "$took" "$tail_line"
    else
        log "unit: FAILED (exit $rc, ${took}s): $tail_line"
        grep -E '^(FAILED|ERROR)' "$OUT_DIR/unit.log" | head -n 20 | sed 's/^/    /' | tee -a "$OUT_DIR/log.txt"
        record unit FAILED "$took" "exit $rc: $tail_line"
        FAILED=1
    fi
fi

SUMMARIZE="$HERE/gpu_check/summarize.py"
[ -f "$SUMMARIZE" ] || SUMMARIZE="$BUNDLE/gpu_check/summarize.py"
echo
"$VPY" "$SUMMARIZE" "$OUT_DIR" | tee "$OUT_DIR/summary.txt"
log "done in $(elapsed)s; results in $OUT_DIR"
exit $FAILED
