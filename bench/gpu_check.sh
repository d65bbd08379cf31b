#!/usr/bin/env bash
# The GPU check, from a fresh checkout in one go (about 10 minutes on an H200 with 16 cores and no network):
#   1. the Python packages the machine's image lacks, from the wheels in --wheels (gguf, pulp, llguidance, and
#      cvxopt for the engine's own solver), installed into .gpu-deps (git-ignored) and put on PYTHONPATH;
#   2. the PowerInfer engine from --powerinfer-src, built for Hopper alone (target `main`, about 50 s), under
#      --build, outside the repository;
#   3. the GPU's hot-FFN kernels, the split that uses them and the .gpuidx bytes, against their references (pytest,
#      on the GPU);
#   4. bench/gpu.py: our split beside the engine's on the same files and budgets, f16 and Q4_0, best of --rounds.
# Without --powerinfer-src the engine's rows are left out; without a GPU everything runs on a simulated GPU side.
#
#   bench/gpu_check.sh [--wheels DIR] [--powerinfer-src DIR] [--build DIR] [--work DIR] [--rounds N] [--tokens N]
#                      [--models LIST]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=""
ENGINE_SRC=""
BUILD="${TMPDIR:-/tmp}/qinfer-powerinfer-build"
WORK=work/bench
ROUNDS=3
TOKENS=64
MODELS=7b-slice
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    --powerinfer-src) ENGINE_SRC="$2"; shift 2 ;;
    --build) BUILD="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --tokens) TOKENS="$2"; shift 2 ;;
    --models) MODELS="$2"; shift 2 ;;
    *) echo "usage: $0 [--wheels DIR] [--powerinfer-src DIR] [--build DIR] [--work DIR] [--rounds N]" \
            "[--tokens N] [--models LIST]" >&2; exit 2 ;;
  esac
done
started=$SECONDS
stage() { echo "== [$((SECONDS - started)) s] $*"; }

if [[ -n "$WHEELS" ]]; then
  stage "installing the wheels in $WHEELS into .gpu-deps"
  "$PY" -m pip install -q --no-index --no-deps --upgrade --target .gpu-deps "$WHEELS"/*.whl
fi
export PYTHONPATH="$PWD/.gpu-deps:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PYTHON'
import importlib.metadata as md
import torch
import qinfer.cli.main  # noqa: F401 - fails here, in one place, if a dependency is missing or too old
names = ("torch", "triton", "transformers", "tokenizers", "gguf", "pulp", "llguidance", "typer", "huggingface_hub")
versions = []
for name in names:
    try:
        versions.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        versions.append(f"{name} missing")
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print(f"{gpu}; " + ", ".join(versions))
PYTHON

MAIN=()
if [[ -n "$ENGINE_SRC" ]]; then
  stage "building the PowerInfer engine from $ENGINE_SRC in $BUILD"
  cmake -S "$ENGINE_SRC" -B "$BUILD" -DLLAMA_CUBLAS=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
    > "$BUILD.cmake.log" 2>&1 || { tail -20 "$BUILD.cmake.log"; exit 1; }
  cmake --build "$BUILD" --target main -j "$(nproc)" > "$BUILD.build.log" 2>&1 || { tail -20 "$BUILD.build.log"; exit 1; }
  MAIN=(--powerinfer-main "$BUILD/bin/main")
  # The engine runs its own solver (powerinfer-py) where a model has no .gpuidx yet.
  export PYTHONPATH="$PYTHONPATH:$(cd "$ENGINE_SRC" && pwd)/powerinfer-py"
fi

stage "the GPU's kernels and split against their references"
"$PY" -m pytest -q -p no:cacheprovider tests/runtime/kernels/test_hot_ffn.py tests/runtime/ffn/test_hybrid_split.py \
  tests/planner/test_planner_gpuidx.py

stage "bench/gpu.py"
"$PY" bench/gpu.py --models "$MODELS" --quant Q4_0 --rounds "$ROUNDS" --tokens "$TOKENS" --work "$WORK" "${MAIN[@]}"
stage "done"
