#!/usr/bin/env bash
# The GPU check, from a fresh checkout in one go (about 10 minutes on an H200 with 16 cores and no network):
#   1. the Python packages the machine's image lacks, from the wheels in --wheels (gguf, pulp, llguidance, and
#      cvxopt for the engine's own solver), installed into .gpu-deps (git-ignored) and put on PYTHONPATH;
#   2. the PowerInfer engine from --powerinfer-src, built for Hopper alone (target `main`, about 50 s), under
#      --build, outside the repository, while step 3 runs;
#   3. the GPU's hot-FFN kernels, the split that uses them (eager and replayed from CUDA graphs) and the .gpuidx
#      bytes, against their references (pytest, on the GPU);
#   4. bench/gpu.py: our split beside the engine's on the same files and budgets, f16 and --quant (Q4_0; none for
#      f16 alone), best of --rounds.
# Without --powerinfer-src the engine's rows are left out; without a GPU everything runs on a simulated GPU side.
#
#   bench/gpu_check.sh [--wheels DIR] [--powerinfer-src DIR] [--build DIR] [--work DIR] [--rounds N] [--tokens N]
#                      [--models LIST] [--quant Q4_0|none] [--budgets GIB,...] [--test-seconds N]
# A 7B's full depth is a run of its own: --models 7b --budgets 4,8 --quant none (its f16 files take 27 GB of disk).
# The wheels, fetched beforehand on a machine with the package index, for the H200 image's Python 3.12 (pip takes
# only the platform tags it is given, and llguidance's abi3 wheel is tagged manylinux_2_31, cvxopt's 2_28):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64 \
#       --platform manylinux_2_28_x86_64 -d DIR 'gguf>=0.18' 'pulp>=3.3.1,<4' 'llguidance>=1.7' cvxopt \
#       pytest iniconfig pluggy pytest-xdist execnet pytest-timeout   # where the image has no pytest
# The script prints the benchmark's table after each round, so a run stopped by a time limit still leaves figures;
# keep its whole output (`bench/gpu_check.sh ... 2>&1 | tee LOG`): a device call returns only its last lines.
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
QUANT=Q4_0
BUDGETS=""
TEST_SECONDS=180
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    --powerinfer-src) ENGINE_SRC="$2"; shift 2 ;;
    --build) BUILD="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --tokens) TOKENS="$2"; shift 2 ;;
    --models) MODELS="$2"; shift 2 ;;
    --quant) QUANT="$2"; shift 2 ;;
    --budgets) BUDGETS="$2"; shift 2 ;;
    --test-seconds) TEST_SECONDS="$2"; shift 2 ;;
    *) echo "usage: $0 [--wheels DIR] [--powerinfer-src DIR] [--build DIR] [--work DIR] [--rounds N]" \
            "[--tokens N] [--models LIST] [--quant Q4_0|none] [--budgets GIB,...] [--test-seconds N]" >&2; exit 2 ;;
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
BUILDER=""
if [[ -n "$ENGINE_SRC" ]]; then
  stage "building the PowerInfer engine from $ENGINE_SRC in $BUILD (in the background)"
  ( cmake -S "$ENGINE_SRC" -B "$BUILD" -DLLAMA_CUBLAS=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF > "$BUILD.cmake.log" 2>&1 &&
    cmake --build "$BUILD" --target main -j "$(( ($(nproc) + 1) / 2 ))" > "$BUILD.build.log" 2>&1 ) &
  BUILDER=$!
  MAIN=(--powerinfer-main "$BUILD/bin/main")
  # The engine runs its own solver (powerinfer-py) where a model has no .gpuidx yet.
  export PYTHONPATH="$PYTHONPATH:$(cd "$ENGINE_SRC" && pwd)/powerinfer-py"
fi

stage "the GPU's kernels and split against their references (at most $TEST_SECONDS s, so the benchmark always runs)"
# Four workers of four threads each, and the engine's build on half the cores: workers that each took every core
# (the CPU's row kernels and torch use OpenMP) beside a build on all of them slowed the first run on an H200 until it
# was stopped, with no test named; the kernels' first builds (triton's compiler, a second or more each) need cores too.
PYTEST=(-p no:cacheprovider -rfE --durations 10)
if "$PY" -c "import xdist" 2>/dev/null; then PYTEST+=(-n 4); fi
if "$PY" -c "import pytest_timeout" 2>/dev/null; then PYTEST+=(--timeout 180); fi
if "$PY" -c "import pytest" 2>/dev/null; then
  OMP_NUM_THREADS=4 timeout "$TEST_SECONDS" "$PY" -m pytest "${PYTEST[@]}" tests/runtime/kernels/test_hot_ffn.py \
    tests/runtime/ffn/test_hybrid_split.py tests/planner/test_planner_gpuidx.py || status=$?
else
  stage "no pytest here, so no tests: add its wheels (pytest, iniconfig, pluggy) to --wheels"
  status=1
fi

if [[ -n "$BUILDER" ]]; then
  if wait "$BUILDER"; then
    stage "the engine is built"
  else
    # Our rows need no engine: the benchmark still runs, without the engine's rows.
    stage "the engine did not build, so its rows are left out:"
    for log in "$BUILD.cmake.log" "$BUILD.build.log"; do
      if [[ -f "$log" ]]; then tail -n 20 "$log"; fi
    done
    MAIN=()
    status=1
  fi
fi

stage "bench/gpu.py"
QUANTIZED=()
if [[ "$QUANT" != none ]]; then QUANTIZED=(--quant "$QUANT"); fi
"$PY" bench/gpu.py --models "$MODELS" "${QUANTIZED[@]}" --rounds "$ROUNDS" --tokens "$TOKENS" --work "$WORK" \
  --budgets "$BUDGETS" "${MAIN[@]}"
stage "done"
exit "${status:-0}"
