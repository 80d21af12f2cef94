#!/usr/bin/env bash
# Build the GPU check's bundle here, to carry to a CUDA machine with no network and no Rust.
#
#   benchmarks/gpu_check_bundle.sh [--out DIR] [--python-version 3.12] [--no-cuda-extras]
#                                  [--split-mib N] [--wheel FILE]
#
# DIR (default .gpu_bundle, git-ignored) gets:
#   wheels/resin/   the abi3 Resin wheel (maturin build --release of this working tree, or
#                   --wheel FILE: resin/_core.abi3.so inside, so the target needs no Rust
#                   toolchain; cp311-abi3 installs on 3.11+; tagged with this machine's glibc)
#   wheels/core/    Resin's runtime dependencies ([project].dependencies in pyproject.toml)
#                   and theirs, as binary wheels for CPython --python-version on manylinux
#                   x86_64 (pip download --only-binary=:all:); pip takes only what the target
#                   lacks
#   wheels/cuda/    unless --no-cuda-extras: the [cuda] extra (flashinfer-python,
#                   nvidia-cutlass-dsl) and what they import that a CUDA torch image does not
#                   have (apache-tvm-ffi, cuda-tile, nvidia-cudnn-frontend, the CUTLASS DSL's
#                   libs-base / libs-core / libs-cu13), installed there with --no-deps
#   tests/          the GPU tests (tests/test_flashinfer_backend.py, test_cutlass_kernels.py
#                   and conftest.py)
#   gpu_check.sh, gpu_check/   the check itself (run DIR/gpu_check.sh on the target)
#   MANIFEST.sha256
# --split-mib N cuts every wheel over N MiB into NAME.whl.part-aa, -ab, ... (joined again by the
# check's install step), for transfers that cap a file or a copy. Prints each part's size.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=$REPO/.gpu_bundle
PYVER=3.12
CUDA_EXTRAS=1
SPLIT_MIB=
WHEEL=
PY=${PYTHON:-$REPO/.venv/bin/python}
# What flashinfer-python and nvidia-cutlass-dsl import beyond a CUDA torch image's packages
# (their other requirements: torch, numpy, ninja, requests, einops, tabulate, click, tqdm,
# packaging, nvidia-ml-py, cuda-bindings, cuda-pathfinder, are already there). The CUTLASS DSL's
# libraries for CUDA 13, matching a cu13x torch.
CUDA_IMPORTS=(apache-tvm-ffi cuda-tile nvidia-cudnn-frontend nvidia-cutlass-dsl-libs-base
    nvidia-cutlass-dsl-libs-core nvidia-cutlass-dsl-libs-cu13)

while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=$2; shift 2 ;;
        --python-version) PYVER=$2; shift 2 ;;
        --no-cuda-extras) CUDA_EXTRAS=0; shift ;;
        --split-mib) SPLIT_MIB=$2; shift 2 ;;
        --wheel) WHEEL=$(cd "$(dirname "$2")" && pwd)/$(basename "$2"); shift 2 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check_bundle: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

cd "$REPO"
PLATFORM_ARGS=(--only-binary=:all: --python-version "$PYVER" --implementation cp
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64)
pip_download() { "$PY" -m pip download -q --disable-pip-version-check "${PLATFORM_ARGS[@]}" "$@"; }
project() {  # a list from pyproject.toml: "dependencies" or "optional:NAME"
    "$PY" - "$1" <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
key = sys.argv[1]
items = project["optional-dependencies"][key.split(":")[1]] if ":" in key else project[key]
print("\n".join(items))
EOF
}

rm -rf "$OUT"
mkdir -p "$OUT/wheels/resin" "$OUT/wheels/core" "$OUT/tests" "$OUT/gpu_check"

echo "gpu_check_bundle: the Resin wheel (maturin build --release)"
if [ -z "$WHEEL" ]; then
    VIRTUAL_ENV=$REPO/.venv PATH=$REPO/.venv/bin:$PATH "$REPO/.venv/bin/maturin" build --release \
        -q -o "$OUT/wheels/resin"
else
    cp "$WHEEL" "$OUT/wheels/resin/"
fi

echo "gpu_check_bundle: runtime dependencies for CPython $PYVER / manylinux x86_64"
mapfile -t DEPS < <(project dependencies)
pip_download -d "$OUT/wheels/core" "${DEPS[@]}"

if [ "$CUDA_EXTRAS" = 1 ]; then
    echo "gpu_check_bundle: CUDA extras (FlashInfer, the CUTLASS DSL) for CPython $PYVER"
    mkdir -p "$OUT/wheels/cuda"
    mapfile -t EXTRAS < <(project optional:cuda)
    pip_download --no-deps -d "$OUT/wheels/cuda" "${EXTRAS[@]}" "${CUDA_IMPORTS[@]}"
fi

cp benchmarks/gpu_check.sh "$OUT/"
cp benchmarks/gpu_check/*.py "$OUT/gpu_check/"
cp tests/conftest.py tests/test_flashinfer_backend.py tests/test_cutlass_kernels.py "$OUT/tests/"

if [ -n "$SPLIT_MIB" ]; then
    find "$OUT/wheels" -name '*.whl' -size +"${SPLIT_MIB}"M | while read -r wheel; do
        split -b "${SPLIT_MIB}m" -a 2 "$wheel" "$wheel.part-"
        rm "$wheel"
        echo "split $(basename "$wheel") into $(ls "$wheel".part-* | wc -l) pieces"
    done
fi

(cd "$OUT" && find . -type f ! -name MANIFEST.sha256 -print0 | sort -z | xargs -0 sha256sum) \
    > "$OUT/MANIFEST.sha256"
echo "gpu_check_bundle: $OUT"
du -sh "$OUT"/wheels/* | sed "s/^/  /"
echo "  total $(du -sh "$OUT" | cut -f1)"
echo "on the CUDA machine: bash $(basename "$OUT")/gpu_check.sh --bundle $(basename "$OUT")"
