#!/usr/bin/env bash
# The GPU path and the multi-node figures, proven in one call on a machine with one NVIDIA
# GPU and many cores but no network (an H200 with 16 cores):
#   bash benchmarks/device/prepare.sh       # here, with network: fills .whl/
#   bash benchmarks/device_check.sh         # there, with .whl/ copied along with the checkout
#   bash benchmarks/device_check.sh --dry-run [--parts 2,4]   # any CPU machine, tiny sizes
#
# Parts, in order; each has its own time limit, writes JSON with provenance and prints one
# line, PASS, FAIL or SKIP, against its target; a failed part does not stop the rest:
#   1. the GPU tests (-m gpu: codec on CuPy, collectives on CuPy buffers between two
#      processes, the torch backend and DDP hook on CUDA tensors; the NVRTC kernel tests)
#      with CGX_UCX_REQUIRE_GPU=1, then GPU codec throughput against a device copy at 1 to
#      256 MiB (benchmarks/gpu_check.py). Target: tests pass, GPU codes equal the CPU's.
#   2. bench nodes: 2 nodes x 2 ranks at 1 Gbit/s, 64 MiB, 4 bits, no UCX variable and no
#      topology hint set by hand, CPU time per rank. Target: two-level >= 1.7x flat and
#      >= 10x gloo, bytes per node within 10% of the formula.
#   3. bench link: 2 ranks at 10 Gbit/s, 64 MiB, 4 bits. Target: <= 1.5x the lower bound.
#   4. python -m cgx_ucx.bench.ddp_peers: DDP of the 22 M-parameter MLP on CUDA tensors,
#      two processes on the one GPU, each in its own namespace, over 1 Gbit/s: gloo, fp16
#      hook, PowerSGD rank 1 and 4, cgx 4-bit backend and hook. Target: cgx 4-bit faster
#      than every peer, held-out loss within 1% of gloo's, replicas equal.
#   5. benchmarks/device/p2p_ipc.py: CuPy buffers between two processes over cuda_ipc
#      against a device copy, and ucx_perftest with CUDA memory when the wheel ships it.
#
# Results: $OUT/<machine class>/ (h200-16core/: gpu_codec.json, gpu_tests.txt, nodes.json,
# link.json, ddp_peers.json, p2p_ipc.json), the lines and provenance in
# $OUT/device_check.json, the whole output in $OUT/device_check.log (without OUT: a new
# folder under /tmp). All parts together stay within CGX_DEVICE_BUDGET_S seconds (465: the
# call's 8 minutes, less the summary); a part gets what is left when its turn comes.
# The dry run (--dry-run, or CGX_DEVICE_DRY_RUN=1) runs every part that can run on a CPU
# with tiny sizes and short limits: part 1 collects the GPU tests and runs the NVRTC ones
# (no GPU needed), parts 2-5 run on host memory; with .whl/ present it also installs the
# wheels into a scratch folder and runs the link emulation through the carried ip and tc.
# --check-args only checks that every part's commands accept their arguments (the real
# sizes, or the dry run's with --dry-run): each stops right after parsing; seconds, no GPU.
# CGX_DEVICE_COMMIT: the commit a copy without .git runs (its results then name it).
# PYTHON selects the interpreter (default: the checkout's .venv in a dry run or a check of
# the arguments, else python3).
# Exit status: the number of parts that failed (in a dry run: that did not run through;
# tiny sizes on a CPU are not held to the targets, the lines still show their figures).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

DRY="${CGX_DEVICE_DRY_RUN:-0}"
CHECK=0
PARTS="1,2,3,4,5"
while (($#)); do
  case "$1" in
    --dry-run) DRY=1 ;;
    --check-args) CHECK=1 ;;
    --parts) PARTS="$2"; shift ;;
    --parts=*) PARTS="${1#--parts=}" ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "unknown option $1 (see --help)"; exit 2 ;;
  esac
  shift
done
if [ "$DRY$CHECK" != 00 ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
  PY="$ROOT/.venv/bin/python"
else
  PY="${PYTHON:-python3}"
fi
export PY PYTHONUNBUFFERED=1
BUDGET="${CGX_DEVICE_BUDGET_S:-$([ "$DRY" = 1 ] && echo 900 || echo 465)}"
OUT_ROOT="${OUT:-/tmp/cgx-device-check-$(date +%Y%m%d-%H%M%S)}"
WORK=$(mktemp -d /tmp/cgx-device-work.XXXXXX)
mkdir -p "$OUT_ROOT"
LINES="$WORK/lines.txt"
: >"$LINES"
exec > >(tee -a "$OUT_ROOT/device_check.log") 2>&1
TEE_PID=$!

echo "== device check $([ "$DRY" = 1 ] && echo '(dry run) ')$(date -u +%FT%TZ), parts $PARTS, budget ${BUDGET} s"
echo "== $(uname -srm), $(nproc) cores, python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
command -v nvidia-smi >/dev/null \
  && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if commit=$(git rev-parse --short HEAD 2>/dev/null); then
  echo "== commit $commit$(git diff --quiet 2>/dev/null || echo ' (tracked files modified)')"
else
  echo "== no git checkout here: the results' provenance names no commit"
fi

if [ "$DRY" = 1 ] && [ -x .whl/iproute/ip ]; then
  export CGX_DEVICE_CARRIED_IPROUTE=1  # exercise the bundle the machine will use
fi
# shellcheck source=benchmarks/device/env.sh
. benchmarks/device/env.sh
ENV_OK=1
device_env "$ROOT" /tmp/cgx-device-site || ENV_OK=0
RES="$OUT_ROOT/$("$PY" -c 'from cgx_ucx.bench.provenance import machine_class; print(machine_class())' 2>/dev/null || echo unknown)"
mkdir -p "$RES"
echo "== results: $RES"

# Parts 2-5 run as a user's job would: no UCX_* or CGX_* variable from this shell.
CLEAN=("$(command -v env)")
for name in $(compgen -e | grep -E '^(UCX|CGX)_' || true); do CLEAN+=(-u "$name"); done

NAMES=("" "GPU tests and codec" "bench nodes 2x2" "bench link 2 ranks" "DDP peers"
       "p2p cuda_ipc")
ENV_BIN=$(command -v env)
NOPATH="$WORK/no-commands"  # --check-args: a PATH without ip/tc stops a run after parsing
mkdir -p "$NOPATH"

left() { echo $((BUDGET - SECONDS)); }
# run_limited SECONDS CMD...: the command under min(SECONDS, what is left); 124 on timeout.
run_limited() {
  local want="$1" have
  shift
  have=$(($(left) - 5))
  ((have < want)) && want=$have
  if ((want < 10)); then
    echo "(no time left for: $*)"
    return 124
  fi
  echo "+ [${want} s] $*"
  timeout -k 10 "$want" "$@"
}
# check_args CMD...: 0 when the command accepts its arguments. It runs with a PATH that
# holds no ip or tc, so the benchmarks stop right after parsing ("link emulation needs");
# an argparse or pytest usage error fails.
check_args() {
  local out
  echo "+ (arguments) $*"
  out=$(timeout -k 5 120 "$ENV_BIN" PATH="$NOPATH" "$@" 2>&1 </dev/null)
  if grep -qE ': error: |unrecognized arguments' <<<"$out"; then
    grep -m2 -E ': error: |unrecognized arguments' <<<"$out"
    return 2
  fi
}
# check_part N CMD-ARRAY-NAMES...: the part's line from check_args of each command.
check_part() {
  local n="$1" bad=0 name
  shift
  for name in "$@"; do
    local words="${name}[@]"
    check_args "${!words}" || bad=1
  done
  if ((bad)); then
    echo "FAIL part $n ${NAMES[$n]}: a command line was refused (above)" | tee -a "$LINES"
  else
    echo "PASS part $n ${NAMES[$n]}: command lines parse" | tee -a "$LINES"
  fi
}
verdict() { "$PY" benchmarks/device/verdict.py "$@" --lines "$LINES"; }
skip() { echo "SKIP part $1 ${NAMES[$1]}: $2" | tee -a "$LINES"; }
wants() { [[ ",$PARTS," == *",$1,"* ]]; }
t() { [ "$DRY" = 1 ] && echo "$2" || echo "$1"; }  # t REAL DRY: the limit of this mode

part1() {
  echo "== part 1: GPU tests and codec throughput"
  local gpu_tests=(tests/test_codec.py tests/test_collectives_gpu.py tests/test_torch_cuda.py)
  local pytest=("$PY" -m pytest -q -p no:cacheprovider -o addopts="")
  local tests_gpu=(env CGX_UCX_REQUIRE_GPU=1 "${pytest[@]}" -m gpu "${gpu_tests[@]}")
  local tests_nvrtc=(env CGX_UCX_REQUIRE_GPU=1 "${pytest[@]}" tests/test_kernels_nvrtc.py)
  local codec=("$PY" benchmarks/gpu_check.py --out "$RES" --sizes 1 16 64 256 --bits 4)
  if [ "$CHECK" = 1 ]; then
    local collect_gpu=("${tests_gpu[@]}" --collect-only)
    local collect_nvrtc=("${tests_nvrtc[@]}" --collect-only)
    check_part 1 collect_gpu collect_nvrtc codec
    return
  fi
  if [ "$DRY" = 1 ]; then
    local collected nvrtc_rc parse_rc
    collected=$(run_limited 60 "${pytest[@]}" -m gpu --collect-only "${gpu_tests[@]}" \
      | grep -oE '^[0-9]+(/[0-9]+)? tests? collected' | cut -d/ -f1 | cut -d' ' -f1)
    run_limited 120 "${pytest[@]}" tests/test_kernels_nvrtc.py | tail -3
    nvrtc_rc=${PIPESTATUS[0]}
    "$PY" benchmarks/gpu_check.py --help >/dev/null
    parse_rc=$?
    local what="${collected:-no} GPU tests collected, NVRTC tests exit $nvrtc_rc"
    what+=", gpu_check.py --help exit $parse_rc"
    if [ -n "$collected" ] && [ "$nvrtc_rc" = 0 ] && [ "$parse_rc" = 0 ]; then
      skip 1 "no GPU in a dry run ($what)"
    else
      echo "FAIL part 1 ${NAMES[1]}: $what" | tee -a "$LINES"
    fi
    return
  fi
  {
    run_limited 90 "${tests_gpu[@]}"
    local rc1=$?
    run_limited 45 "${tests_nvrtc[@]}"
    local rc2=$?
    exit $((rc1 || rc2))
  } 2>&1 | tee "$RES/gpu_tests.txt"
  local tests_rc=${PIPESTATUS[0]}
  run_limited 60 "${codec[@]}"
  verdict 1 --rc $? --tests-rc "$tests_rc" --json "$RES/gpu_codec.json"
}

# run_part N SECONDS-REAL SECONDS-DRY RESULT CMD...: run (or check) a one-command part,
# keep its result JSON in $RES and print its line.
run_part() {
  local n="$1" limit result="$4"
  limit=$(t "$2" "$3")
  shift 4
  local cmd=("${CLEAN[@]}" "$@")
  if [ "$CHECK" = 1 ]; then
    check_part "$n" cmd
    return
  fi
  run_limited "$limit" "${cmd[@]}"
  local rc=$?
  [ -f "$result" ] && [ "$(dirname "$result")" != "$RES" ] && cp "$result" "$RES/"
  verdict "$n" --rc "$rc" --json "$result"
}

part2() {
  echo "== part 2: bench nodes 2x2, 1 Gbit/s, 64 MiB, 4 bits"
  local size=64 iters=(--min-iters 4 --max-iters 6) probe=2
  [ "$DRY" = 1 ] && size=1 iters=(--min-iters 1 --max-iters 2 --budget 0.5) probe=0.3
  run_part 2 100 300 "$WORK/nodes/nodes.json" "$PY" -m cgx_ucx.bench nodes --nodes 2 \
    --ranks-per-node 2 --rates 1gbit --sizes "$size" --bits 4 --no-train "${iters[@]}" \
    --probe-seconds "$probe" --timeout 60 --out-dir "$WORK/nodes"
}

part3() {
  echo "== part 3: bench link, 2 ranks, 10 Gbit/s, 64 MiB, 4 bits"
  local size=64 iters=(--min-iters 4 --max-iters 8) probe=2
  [ "$DRY" = 1 ] && size=1 iters=(--min-iters 1 --max-iters 2 --budget 0.5) probe=0.3
  run_part 3 75 240 "$WORK/link/link.json" "$PY" -m cgx_ucx.bench link --world 2 \
    --rates 10gbit --sizes "$size" --bits 4 "${iters[@]}" --probe-seconds "$probe" \
    --timeout 60 --out-dir "$WORK/link"
}

part4() {
  echo "== part 4: DDP step against PyTorch's compression hooks, 1 Gbit/s"
  local args=(--device cuda --steps 10 --warmup 3 --probe-seconds 1 --timeout 60)
  [ "$DRY" = 1 ] && args=(--device cpu --input 32 --hidden 64 --steps 2 --warmup 2
    --batch 8 --probe-seconds 0.3 --timeout 60)
  run_part 4 170 300 "$WORK/ddp/ddp_peers.json" "$PY" -m cgx_ucx.bench.ddp_peers \
    --rate 1gbit "${args[@]}" --out-dir "$WORK/ddp"
}

part5() {
  echo "== part 5: point-to-point between two processes of one GPU"
  local args=(--device cuda --sizes 1 16 64 256)
  [ "$DRY" = 1 ] && args=(--device cpu --sizes 1 4 --max-iters 20)
  run_part 5 50 120 "$RES/p2p_ipc.json" "$PY" benchmarks/device/p2p_ipc.py "${args[@]}" \
    --timeout 60 --out-dir "$RES"
}

if [ "$DRY" = 1 ] && [ "$CHECK" = 0 ] && compgen -G .whl/*.whl >/dev/null; then
  # The machine installs these wheels for its own Python; installing them here proves the
  # files are whole and the command works (they are not used here).
  echo "== dry run: installing the carried wheels into a scratch folder"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target "$WORK/site" .whl/*.whl && echo "   wheels install: $(ls "$WORK/site" | tr '\n' ' ')"
fi

if [ "$ENV_OK" = 0 ]; then
  for n in 1 2 3 4 5; do wants $n && skip "$n" "ucxx is not importable (see above)"; done
else
  for n in 1 2 3 4 5; do
    if wants $n; then
      part$n
    fi
  done
fi

echo
echo "== summary ($SECONDS s of ${BUDGET} s)"
cat "$LINES"
"$PY" benchmarks/device/verdict.py summary --lines "$LINES" --out "$OUT_ROOT/device_check.json" \
  --results "$RES" ${CGX_DEVICE_COMMIT:+--commit "$CGX_DEVICE_COMMIT"}
echo "== results in $OUT_ROOT: $(cd "$OUT_ROOT" && find . -type f | sort | tr '\n' ' ')"
if [ "$DRY" = 1 ]; then
  # Tiny sizes on a CPU miss the targets: a dry run fails where a part did not run through.
  failed=$(grep -cE '^FAIL .*(exit [0-9]+|ran past|no result|unreadable|refused)' "$LINES")
else
  failed=$(grep -c '^FAIL' "$LINES")
fi
rm -rf "$WORK"
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null  # the log is complete when the call returns
exit "$failed"
