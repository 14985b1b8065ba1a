#!/usr/bin/env bash
# GPU check of the codec and the collectives, one command on a machine with an NVIDIA GPU:
#   bash benchmarks/gpu_check.sh [gpu_check.py options]
# 1. installs what is missing (numpy numba ml_dtypes cupy-cuda12x pytest ...) with pip,
# 2. runs the GPU tests with CGX_UCX_REQUIRE_GPU=1 (a missing GPU fails, not skips): the
#    codec's (the ``gpu`` cases of tests/test_codec.py), the NVRTC kernel tests, and the
#    engine's collectives on CuPy buffers between two processes on one GPU (cuda_ipc), and
#    the torch backend and DDP hook on CUDA tensors (tests/test_torch_cuda.py, when torch
#    is installed),
# 3. prints GPU encode/decode/decode_add throughput next to a device-to-device copy and
#    writes benchmarks/results/<machine class>/gpu_codec.json (+ gpu_tests.txt; the class
#    names the GPU and the cores, e.g. h200-16core); copies both to $OUT when set. Then
#    `python -m cgx_ucx.bench report` puts the figures on docs/benchmarks.md.
# The package runs from this checkout (PYTHONPATH), nothing is installed for it.
# PYTHON selects the interpreter (default: python3); WHEELHOUSE a folder of wheels to
# install from instead of the index (machines without network). Exit status: non-zero if
# a test failed or GPU bytes differ from the CPU's.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
echo "== python: $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

need=()
for spec in numpy:numpy numba:numba ml_dtypes:ml_dtypes "cupy:cupy-cuda12x>=13" \
            ucxx:ucxx-cu12 pytest:pytest pytest_timeout:pytest-timeout hypothesis:hypothesis; do
  mod="${spec%%:*}"; pkg="${spec#*:}"
  $PY -c "import $mod" 2>/dev/null || need+=("$pkg")
done
if ((${#need[@]})); then
  # WHEELHOUSE: a folder of wheels for a machine without network (pip download them
  # elsewhere for its Python and platform; ucxx-cu12 needs libucxx-cu12, libucx-cu12,
  # librmm-cu12 and rapids-logger too).
  if [ -n "${WHEELHOUSE:-}" ]; then
    echo "== pip install --no-index --no-deps $WHEELHOUSE/*.whl (missing: ${need[*]})"
    $PY -m pip install --quiet --no-index --no-deps "$WHEELHOUSE"/*.whl \
      || { echo "cannot install the wheels of $WHEELHOUSE"; exit 3; }
  else
    echo "== pip install ${need[*]}"
    $PY -m pip install --quiet "${need[@]}" || { echo "cannot install ${need[*]}"; exit 3; }
  fi
fi
# CuPy compiles kernels with NVRTC: take it from pip when no CUDA toolkit provides it
if ! $PY -c "import cupy; cupy.cuda.nvrtc.getVersion()" 2>/dev/null; then
  echo "== pip install nvidia-cuda-nvrtc-cu12"
  $PY -m pip install --quiet nvidia-cuda-nvrtc-cu12 || { echo "no NVRTC for CuPy"; exit 3; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
RESULTS="benchmarks/results/$($PY -c 'from cgx_ucx.bench.provenance import machine_class; print(machine_class())')"
mkdir -p "$RESULTS"

echo "== tests (CGX_UCX_REQUIRE_GPU=1)"
# -m gpu: the GPU cases of the codec tests (the cupy side of the shared xp bodies and the
# GPU-only tests) and the collectives on CuPy buffers; then the NVRTC kernel tests, whole.
{
  CGX_UCX_REQUIRE_GPU=1 $PY -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
    tests/test_codec.py tests/test_collectives_gpu.py tests/test_torch_cuda.py
  codec_rc=$?
  CGX_UCX_REQUIRE_GPU=1 $PY -m pytest -q -p no:cacheprovider -o addopts="" \
    tests/test_kernels_nvrtc.py
  nvrtc_rc=$?
  exit $((codec_rc || nvrtc_rc))
} 2>&1 | tee "$RESULTS/gpu_tests.txt"
tests_rc=${PIPESTATUS[0]}

echo "== throughput"
$PY benchmarks/gpu_check.py --out "$RESULTS" "$@"
bench_rc=$?

if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then
  cp "$RESULTS/gpu_codec.json" "$RESULTS/gpu_tests.txt" "$OUT"/ 2>/dev/null || true
fi
echo "== tests exit $tests_rc, check exit $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
