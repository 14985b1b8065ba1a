#!/usr/bin/env bash
# The main job: creates the environment from nothing (scripts/setup_env.sh), then trains a
# small CNN on scikit-learn's digits on 2 ranks with torchrun, once with 4-bit cgx_hook on
# the cgx backend and once uncompressed on gloo, and prints accuracy, mean step time and
# bytes sent per step for each (an epoch line while it runs), then writes a JSON record and
# a PNG (loss and bytes per step) to a new ./cgx_bench_results/<timestamp>/ (--out-dir DIR
# or --json FILE name another place).
# Ends in well under 5 minutes on a 2-core CPU machine.
# Usage: bash scripts/train.sh [train_digits.py args, e.g. --bits 8 --epochs 20, --quiet]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
echo "train: digits CNN on 2 ranks (torchrun): 4-bit cgx, then gloo fp32 (~20-60 s)"
exec .venv/bin/torchrun --standalone --nproc-per-node 2 examples/train_digits.py "$@"
