#!/usr/bin/env bash
# Re-run every CPU benchmark that docs/benchmarks.md shows, with the options of its tracked
# result, into benchmarks/results/<machine class>/ of this checkout, then render the page:
#   sudo bash benchmarks/refresh.sh         # about 28 minutes on 2 cores (steps: below)
#   DRY_RUN=1 bash benchmarks/refresh.sh    # only check that every command line parses
# Needs root (link, nodes and train --link-rate build network namespaces) and a quiet
# machine: each JSON records the load before and after its run. PYTHON selects the
# interpreter (default: the checkout's .venv, else python3). A failing step stops the script.
# The GPU figures come from benchmarks/gpu_check.sh on a GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
DRY_RUN="${DRY_RUN:-}"
if [ -z "$DRY_RUN" ] && [ "$(id -u)" -ne 0 ]; then
  echo "run as root: the link, nodes and train --link-rate steps build network namespaces" >&2
  exit 2
fi
CLASS="$("$PYTHON" -c 'from cgx_ucx.bench.provenance import machine_class; print(machine_class())')"
DEST="benchmarks/results/$CLASS"
CASES="$(mktemp -d)"  # results of the cases a benchmark writes under its own name
trap 'rm -rf "$CASES"' EXIT
START=$SECONDS

# bench NAME ARGS...: python -m cgx_ucx.bench NAME ARGS...; with DRY_RUN=1 its options are
# parsed by the benchmark's own parser and nothing runs.
bench() {
  if [ -n "$DRY_RUN" ]; then
    "$PYTHON" - "$@" <<'EOF'
import argparse
import importlib
import sys

name, argv = sys.argv[1], sys.argv[2:]
parse = argparse.ArgumentParser.parse_args


def parse_only(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise SystemExit(0)


argparse.ArgumentParser.parse_args = parse_only
try:
    importlib.import_module(f"cgx_ucx.bench.{name}").main(argv)
except SystemExit as exc:
    if exc.code:
        raise
print(f"   parses: {name} {' '.join(argv)}")
EOF
  else
    "$PYTHON" -m cgx_ucx.bench "$@"
  fi
}

# keep CASE FILE: move a case's result (written under the benchmark's name) to FILE.json
keep() {
  [ -n "$DRY_RUN" ] || mv "$CASES/$1/$2.json" "$DEST/$3.json"
}

step() {
  echo
  echo "== [$(( (SECONDS - START) / 60 )) min] $*"
}

echo "refreshing $DEST with $PYTHON${DRY_RUN:+ (dry run: parsing the command lines only)}"

step "1/12 codec: 3 sizes x 3 widths, 15 repeats, NumPy reference (about 2 min)"
bench codec --repeat 15 --refresh-tracked

step "2/12 allreduce: 2 and 4 ranks, 1-256 MiB, gloo and 4 widths, p2p (about 2 min)"
bench allreduce --refresh-tracked

step "3/12 latency: 2 and 4 ranks, 4 KiB-4 MiB and barriers, three paths (about 2 min)"
bench latency --refresh-tracked

step "4/12 latency --cold: the first compressed call on an empty Numba cache (about 1 min)"
bench latency --cold --world 2 --sizes-kib 4 --bits 4 --iters 60 --out-dir "$CASES/cold"
keep cold latency latency_cold

step "5/12 link --train: 2 and 4 ranks at 1 and 10 Gbit/s, 1-256 MiB, DDP (about 6 min)"
bench link --train --refresh-tracked

step "6/12 link --fsdp: 2 ranks at 1 Gbit/s, 64 MiB, FSDP2 training (about 3 min)"
bench link --rates 1gbit --world 2 --sizes 64 --bits 4 32 --fsdp --out-dir "$CASES/fsdp"
keep fsdp link link_1gbit_fsdp

step "7/12 nodes: 2 x 2 ranks at 1 and 10 Gbit/s, 16 and 64 MiB, DDP (about 4 min)"
bench nodes --rates 1gbit 10gbit --sizes 16 64 --refresh-tracked

step "8/12 contention: DDP quiet and beside 8 busy loops, 2 repeats (about 2 min)"
bench contention --refresh-tracked

step "9/12 train: compression policies on loopback, 3 repeats (about 1 min)"
bench train --refresh-tracked

step "10/12 train --link-rate 1gbit: the same over an emulated 1 Gbit/s link (about 1 min)"
bench train --link-rate 1gbit --refresh-tracked

step "11/12 memory: 2 ranks, 16 MiB-1 GiB, gloo and cgx at 32 and 4 bits, loopback (about 4 min)"
bench memory --sizes 16 64 256 1024 --refresh-tracked

step "12/12 report: docs/benchmarks.md, its plots and the README's headline table"
if [ -n "$DRY_RUN" ]; then
  "$PYTHON" -m cgx_ucx.bench report --check || true
else
  "$PYTHON" -m cgx_ucx.bench report
fi
echo
echo "done in $(( (SECONDS - START) / 60 )) min; review with git diff $DEST docs README.md"
